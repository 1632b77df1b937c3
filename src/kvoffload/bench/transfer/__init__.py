"""Transfer benchmarks: GPU <-> CPU block copy bandwidth.

- ``bandwidth``: ``kvoffload bench transfer``: block store / load bandwidth through
  ``OffloadingWorker`` against one bulk copy of the same bytes (the practical limit);
- ``args``: its flags, kept apart so ``kvoffload bench transfer --help`` needs no torch.
"""
