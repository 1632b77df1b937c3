"""Tier benchmarks: the lower tiers (disk, Redis) below the CPU tier.

- ``throughput``: ``kvoffload bench tiers``: put / get throughput of each tier against
  raw I/O of the same bytes, per block size: ``disk_io`` (the disk store and its
  handler vs sequential ``pwrite`` / ``pread``), ``redis_io`` (the Redis store vs plain
  pipelined ``SET`` / ``MGET``); ``common``: sizes, timing, batches, keys;
- ``vllm_fs``: ``kvoffload bench tiers-vllm``: kvoffload's disk tier against vLLM's fs
  tier, both as secondary tiers under vLLM's own tiering manager (``vllm_side``: that
  manager driven as vLLM's scheduler drives it).
"""
