"""kvoffload: KV-cache offloading for LLM serving.

Layers, from the base up (a package imports only those before it):
hashing, blocks, events, offload, transfer, connector, engine, bench/cli.
"""

__version__ = "0.1.0"
