"""The measurement wing: ``kvoffload bench NAME``, one sub-package per family.

- ``core``: the block pool's free queue and KV event throughput (``blocks``, ``events``);
- ``policy``: CPU-tier cache policies replayed on traces, the policy suite, KV cache
  groups (``offload``, ``hybrid``);
- ``transfer``: GPU <-> CPU copy bandwidth (``transfer``);
- ``tiers``: disk and Redis tiers (``tiers``, ``tiers-vllm``);
- ``serving``: the reference engine serving a workload (``serve``, ``threads``);
- ``routing``: engines behind a KV-aware router (``route``);
- ``vllm``: a real vLLM engine with kvoffload's connector (``vllm``).

Nothing in the product imports this package; the commands' table is
``kvoffload.cli.main.BENCHMARKS``.
"""
