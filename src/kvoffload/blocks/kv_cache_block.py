"""One block of the GPU tier's paged KV cache, as the scheduler sees it."""

from __future__ import annotations

from kvoffload.hashing import BlockHash


class KVCacheBlock:
    """Metadata of one physical KV block; no tensors.

    ``prev_free_block`` / ``next_free_block`` are the links of the intrusive
    free queue: they are non-None exactly while the block is in the queue, and
    only ``FreeKVCacheBlockQueue`` reads or writes them.

    ``alloc_epoch`` counts how often the block left the free queue (allocated
    or hit). A walker that saved the block as a cursor compares it to tell
    "still where I left it" from "taken and freed again at the tail", which
    membership alone cannot.
    """

    __slots__ = (
        "alloc_epoch",
        "block_hash",
        "block_id",
        "is_null",
        "next_free_block",
        "prev_free_block",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False
        self.alloc_epoch = 0

    def reset_hash(self) -> None:
        self.block_hash = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"
