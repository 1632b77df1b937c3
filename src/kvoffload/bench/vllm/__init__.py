"""vLLM benchmarks: a real vLLM engine (vLLM's CPU build, in its own venv) with kvoffload.

- ``engine``: ``kvoffload bench vllm``: the same prompts with offload off and on (cached
  tokens, TTFT, identical outputs); it writes a job and runs ``runner`` with the engine
  venv's Python;
- ``hits``: ``kvoffload bench vllm --hits``: how close a CPU-tier hit comes to a device
  hit; ``hit_profile`` is the timed connector of ``--profile-hit``;
- ``model``: the tiny random Llama the engine loads offline;
- ``runner``: the engine side (``python -m kvoffload.bench.vllm.runner JOB OUT``).
"""
