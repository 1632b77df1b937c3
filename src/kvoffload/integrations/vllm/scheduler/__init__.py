"""The plug-in's scheduler side: what runs in vLLM's scheduler process (no tensors).

- ``manager``: ``KVOffloadManager``, vLLM's ``OffloadingManager`` over kvoffload's CPU tier;
- ``class_managers``: one CPU manager per slot class (groups of different slot sizes);
- ``tiering``: vLLM's tiering manager over kvoffload's disk / Redis tiers (with lower tiers);
- ``policies``: kvoffload's policies as vLLM ``CachePolicy`` classes (``KVOffload<Name>Policy``);
- ``store_threshold``: vLLM's ``store_threshold`` (store on the n-th offer);
- ``sync_loads``: CPU-tier hits computed in the step they are found (vLLM 0.32);
- ``connector_build``: what ``KVOffloadConnector`` tells the spec vLLM builds in its constructor.
"""
