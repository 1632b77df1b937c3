"""Policy benchmarks: what the CPU tier keeps, replayed on block traces (no model).

- ``offload``: ``kvoffload bench offload``: CPU-tier cache policies replayed on a
  Mooncake-format trace against vLLM's managers, LRU and Belady (``offload_report``
  prints it); ``--suite`` runs ``suite`` (every policy on held-out trace families;
  ``suite_hybrid`` its hybrid family, KV cache groups with chunk units; ``suite_cache``
  keeps vLLM's rows, ``suite_report`` prints the tables);
- ``vllm_replay``: vLLM's own CPU offloading manager driven as ``offload`` drives ours;
- ``traces``: block-level traces (loading, seeded generators); ``mooncake``: replaying a
  Mooncake trace through the GPU block pool and the CPU tier (``kvoffload bench serve
  --mooncake``);
- ``hybrid_replay``: ``kvoffload bench hybrid``: KV cache groups (full attention +
  sliding windows) on a CPU tier, chunk units against vLLM's lru / arc
  (``hybrid_workloads``: its prompts; ``hybrid_windows``: vLLM's per-group hit and the
  store rules; ``hybrid_windows_bench``: ``--windows``, extra window stores at equal bytes);
- ``replay``: the policy replay ``offload`` and ``suite`` share (lookup, load, admit, store;
  Belady's MIN, the ceiling).
"""
