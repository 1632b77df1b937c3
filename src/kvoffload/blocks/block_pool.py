"""The GPU-tier block pool: allocation, ref counts and the prefix cache.

A block is in one of three states:
- in use: ``ref_cnt > 0``, held by one or more requests, not in the free queue;
- free and cached: ``ref_cnt == 0`` with a ``block_hash``; still a prefix hit
  until it is reallocated, which is when its hash is evicted;
- free and empty: ``ref_cnt == 0``, no hash.

Eviction order is the free queue's order: ``get_new_blocks`` takes blocks from
its front and evicts whatever hash they still carry. Freed empty blocks go to
the front and freed cached blocks to the tail (as vLLM 0.33's pool does), so
an allocation reuses blocks that hold nothing before it evicts any cached
one. Callers free a request's blocks tail first (``free_request_blocks`` does
it), so within a chain the last block is evicted before its parents: a kept
head is still a usable prefix, a kept tail without its head is not.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvoffload.blocks.free_queue import FreeKVCacheBlockQueue
from kvoffload.blocks.kv_cache_block import KVCacheBlock
from kvoffload.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvoffload.hashing import BlockHash, block_extra_keys, event_extra_keys


class BlockPool:
    """``num_blocks`` GPU blocks; block 0 is the null block and is never cached."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        # hash -> block, or hash -> {block_id: block} once duplicates exist; the
        # common single-block case costs no inner dict.
        self.cached_block_hash_to_block: dict[
            BlockHash, KVCacheBlock | dict[int, KVCacheBlock]
        ] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVEvent] = []
        # Blocks taken from / put at the queue's front since start: lets a lazy
        # offloader know how far the front moved without walking it.
        self.num_allocated_total = 0
        self.num_prepended_total = 0

    # -- prefix cache -------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding ``block_hash`` (any of them when duplicated), or None."""
        entry = self.cached_block_hash_to_block.get(block_hash)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        token_ids: Sequence[int] | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Cache ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes.

        ``blocks`` and ``block_hashes`` are the request's, from its first block;
        ``token_ids`` the request's tokens, ``lora_name`` and ``cache_salt`` its
        hash inputs (needed only for events: ``BlockStored.extra_keys`` holds
        each new block's extra keys, untagged, as vLLM publishes them).
        """
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        if len(block_hashes) < num_full_blocks or len(blocks) < num_full_blocks:
            raise ValueError(
                f"cache_full_blocks: {num_full_blocks} full blocks but {len(blocks)} blocks "
                f"and {len(block_hashes)} hashes"
            )
        new_hashes: list[bytes] = []
        table = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            if block.block_hash is not None:
                raise ValueError(f"cache_full_blocks: {block!r} is already cached")
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            entry = table.get(block_hash)
            if entry is None:
                table[block_hash] = block
            elif isinstance(entry, KVCacheBlock):
                table[block_hash] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block
            new_hashes.append(block_hash)
        if self.enable_kv_cache_events and new_hashes:
            parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            tokens = (
                list(token_ids[num_cached_blocks * block_size : num_full_blocks * block_size])
                if token_ids is not None
                else []
            )
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=new_hashes,
                    parent_block_hash=parent,
                    token_ids=tokens,
                    block_size=block_size,
                    lora_id=lora_id,
                    medium=MEDIUM_GPU,
                    lora_name=lora_name,
                    extra_keys=[
                        event_extra_keys(block_extra_keys(i, lora_name, cache_salt))
                        for i in range(num_cached_blocks, num_full_blocks)
                        if not blocks[i].is_null
                    ],
                )
            )

    def _evict_cached_hash(self, block: KVCacheBlock) -> bool:
        block_hash = block.block_hash
        if block_hash is None:
            return False
        table = self.cached_block_hash_to_block
        entry = table.get(block_hash)
        if isinstance(entry, KVCacheBlock):
            if entry is block:
                del table[block_hash]
        elif entry is not None:
            entry.pop(block.block_id, None)
            if len(entry) == 1:
                table[block_hash] = next(iter(entry.values()))
        block.block_hash = None
        return True

    # -- allocation ---------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Allocate ``num_blocks`` from the front of the free queue (ref 1 each).

        Cached blocks among them lose their hash (evicted, one ``BlockRemoved``).
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        evicted: list[bytes] = []
        for block in blocks:
            if block.block_hash is not None:
                evicted.append(block.block_hash)  # type: ignore[arg-type]
                self._evict_cached_hash(block)
            block.ref_cnt += 1
            block.alloc_epoch += 1
        self.num_allocated_total += num_blocks
        if evicted and self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved(block_hashes=evicted, medium=MEDIUM_GPU))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: take the blocks (ref up), out of the free queue if free."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.remove(block)
                block.alloc_epoch += 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one ref of each block; those reaching 0 enter the free queue.

        ``ordered_blocks`` is in eviction order: the first one that becomes free
        is evicted first. For one request's blocks that is tail first; see
        ``free_request_blocks``. Freed blocks that hold no cached hash (or all
        of them, with caching off) go to the queue's front, in that order,
        ahead of every cached block; cached ones go to the tail.
        """
        cached: list[KVCacheBlock] = []
        empty: list[KVCacheBlock] = []
        caching = self.enable_caching
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"free_blocks: {block!r} is not in use")
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                (cached if caching and block.block_hash is not None else empty).append(block)
        if empty:
            self.free_block_queue.prepend_n(empty)
            self.num_prepended_total += len(empty)
        self.free_block_queue.append_n(cached)

    def free_request_blocks(self, request_blocks: Sequence[KVCacheBlock]) -> None:
        """Free one request's blocks (given head first) so its tail is evicted first."""
        self.free_blocks(reversed(request_blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refuses (False) while any block is in use."""
        num_used = self.num_blocks - 1 - self.free_block_queue.num_free_blocks
        if num_used > 0:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # -- introspection ------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks that are in use."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def take_events(self) -> list[KVEvent]:
        """Events since the last call (empty when events are disabled)."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
