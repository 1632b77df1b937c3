"""Routing benchmark: N engine instances behind a KV-aware router.

``kvoffload bench route`` (``route``): the same requests routed KV-aware (NVIDIA Dynamo's
indexer over kvoffload's KV events), round robin and at random; hit rates, TTFT and
throughput per router. Its parts: ``workloads`` (the requests), ``worker`` (one engine
process per instance), ``indexer`` (Dynamo's indexer: client and launcher), ``services``
(Redis and the indexer), ``routers`` (the routers), ``routed_run`` (one routed run),
``report`` (tables and the plot), ``chunks`` (what a router may count of an instance whose
offloaded chunks are several GPU blocks).
"""
