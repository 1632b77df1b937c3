"""Core micro-benchmarks: the GPU block pool and the KV event wire.

- ``blocks``: ``kvoffload bench blocks``: free block queue churn (allocate, free, prefix
  hits out of the middle, the lazy offloader's cursor walk) against a list baseline;
- ``events``: ``kvoffload bench events``: KV event publish / decode rates and live delivery
  on loopback, vLLM's wire profile against the legacy one.
"""
