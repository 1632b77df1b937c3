"""Plug-ins that put kvoffload's tiers inside other serving engines.

Each sub-package imports its engine and is importable only where that engine
is installed; the core ``kvoffload`` package never imports them.
"""
