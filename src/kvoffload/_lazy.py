"""Lazy re-exports for package ``__init__`` modules.

A package lists where each public name lives; nothing is imported until a name
is first read, so ``import kvoffload.<package>`` (and every ``--help``) stays
free of torch, ZMQ and vLLM. Each name resolves to the very object its module
defines, read at access time (a value a module rebinds later is never stale).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, where: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that loads ``name`` from ``where[name]`` on first use.

    A name missing from ``where`` is the ``AttributeError`` Python itself would
    raise, so ``hasattr`` and ``from package import missing`` behave as usual.
    """

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
