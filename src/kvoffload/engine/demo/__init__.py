"""``kvoffload run``'s demo: the built-in workload, the serving loop and ``--verify``.

- ``workload``: a seeded multi-turn chat trace (token ids only, nothing model-specific);
- ``serving``: drive the reference engine through a trace and summarise what happened;
- ``verify``: compare two runs' sampled logits rows and tokens bit for bit.

The serving benchmarks (``kvoffload.bench``) use it; it never imports them.
"""
