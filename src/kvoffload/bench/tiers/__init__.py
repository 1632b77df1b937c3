"""Tier benchmarks: the lower tiers (disk, Redis) below the CPU tier.

- ``throughput``: ``kvoffload bench tiers``: disk and Redis tier put / get throughput
  against raw I/O of the same bytes;
- ``vllm_fs``: ``kvoffload bench tiers-vllm``: kvoffload's disk tier against vLLM's fs
  tier, both as secondary tiers under vLLM's own tiering manager.
"""
