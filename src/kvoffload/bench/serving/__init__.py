"""Serving benchmarks: the reference engine serving the demo workload.

- ``serve``: ``kvoffload bench serve``: one seeded trace served with offload off, eager,
  lazy and each CPU-tier policy side by side (hit rate per tier, TTFT); ``--mooncake``
  replays a Mooncake trace at scale without a model;
- ``threads``: ``kvoffload bench threads``: ``kvoffload run`` quiet, then beside a busy
  process (wall times and their ratio).
"""
