"""The plug-in's worker side: GPU <-> CPU bytes in each vLLM worker process (no policy).

- ``worker``: ``KVOffloadWorker``, vLLM's ``OffloadingWorker`` over kvoffload's transfer layer;
- ``chunk_rows``: an offloaded block that spans several GPU blocks (shared-region rows);
- ``group_jobs``: one job over KV cache groups whose slots live in different host pools;
- ``layer_loads``: synchronous loads copied layer by layer under the forward pass;
- ``shm_lifetime``: the shared CPU region in ``/dev/shm`` never outlives its engine.
"""
