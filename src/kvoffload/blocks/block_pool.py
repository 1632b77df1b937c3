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

KV events (``enable_kv_cache_events``) describe the *set* of hashes the GPU
tier holds (``events_mode="exact"``, the default): ``BlockStored`` when a
hash gets its first copy, ``BlockRemoved`` when its last copy is evicted.
Two requests that computed the same block hold two copies; evicting one is
silent. The copy count of a hash is the size of its entry in
``cached_block_hash_to_block`` (a block, or a dict of blocks once
duplicated), so the rule costs no scan. ``events_mode="per-copy"`` is vLLM
0.33's stream: one store per cached block and one removal per evicted
block, for consumers that reference-count. ``event_listeners`` see the
exact stream in both modes (the self-describing tracker of the offloaded
tiers learns block metadata from it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvoffload.blocks.free_queue import FreeKVCacheBlockQueue
from kvoffload.blocks.kv_cache_block import KVCacheBlock
from kvoffload.events import (
    EVENTS_EXACT,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEvent,
    check_events_mode,
)
from kvoffload.hashing import BlockHash, block_extra_keys, event_extra_keys


class BlockPool:
    """``num_blocks`` GPU blocks; block 0 is the null block and is never cached."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        events_mode: str = EVENTS_EXACT,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.events_mode = check_events_mode(events_mode)
        self._per_copy = events_mode != EVENTS_EXACT
        # Called with every exact-stream event as it happens (both modes), while
        # events are enabled; see the module docstring.
        self.event_listeners: list[Callable[[KVEvent], None]] = []
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
        table = self.cached_block_hash_to_block
        # Indices of blocks whose hash had no copy before: the exact stream's stores.
        first_copies: list[int] = []
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
                first_copies.append(i)
            elif isinstance(entry, KVCacheBlock):
                table[block_hash] = {entry.block_id: entry, block.block_id: block}
            else:
                entry[block.block_id] = block
        if not self.enable_kv_cache_events:
            return
        request = (block_hashes, block_size, token_ids, lora_id, lora_name, cache_salt)
        exact: list[KVEvent] = []
        run_start = prev = -2
        for i in (*first_copies, -1):
            if i != prev + 1:
                if run_start >= 0:
                    exact.append(self._stored_event(request, range(run_start, prev + 1)))
                run_start = i
            prev = i
        if self._per_copy:
            copies = [i for i in range(num_cached_blocks, num_full_blocks) if not blocks[i].is_null]
            if copies:
                # vLLM's layout: one event over the whole range, null blocks' tokens included.
                event = self._stored_event(request, range(num_cached_blocks, num_full_blocks))
                event.block_hashes = [block_hashes[i] for i in copies]
                event.extra_keys = [
                    event_extra_keys(block_extra_keys(i, lora_name, cache_salt)) for i in copies
                ]
                self.kv_event_queue.append(event)
        else:
            self.kv_event_queue.extend(exact)
        for listener in self.event_listeners:
            for exact_event in exact:
                listener(exact_event)

    @staticmethod
    def _stored_event(
        request: tuple[
            Sequence[BlockHash], int, Sequence[int] | None, int | None, str | None, str | None
        ],
        indices: range,
    ) -> BlockStored:
        """``BlockStored`` of the request's blocks ``indices`` (consecutive, chained)."""
        block_hashes, block_size, token_ids, lora_id, lora_name, cache_salt = request
        first, end = indices.start, indices.stop
        return BlockStored(
            block_hashes=[block_hashes[i] for i in indices],
            parent_block_hash=block_hashes[first - 1] if first > 0 else None,
            token_ids=(
                list(token_ids[first * block_size : end * block_size])
                if token_ids is not None
                else []
            ),
            block_size=block_size,
            lora_id=lora_id,
            medium=MEDIUM_GPU,
            lora_name=lora_name,
            extra_keys=[
                event_extra_keys(block_extra_keys(i, lora_name, cache_salt)) for i in indices
            ],
        )

    def _evict_cached_hash(self, block: KVCacheBlock) -> bool:
        """Drop ``block``'s hash from the cache; True when it was the hash's last copy."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        table = self.cached_block_hash_to_block
        entry = table.get(block_hash)
        last = False
        if isinstance(entry, KVCacheBlock):
            if entry is block:
                del table[block_hash]
                last = True
        elif entry is not None:
            entry.pop(block.block_id, None)
            if len(entry) == 1:
                table[block_hash] = next(iter(entry.values()))
            elif not entry:
                del table[block_hash]
                last = True
        block.block_hash = None
        return last

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
        copies: list[ExternalBlockHash] = []  # every evicted copy (per-copy stream)
        last: list[ExternalBlockHash] = []  # hashes whose last copy left (exact stream)
        for block in blocks:
            block_hash = block.block_hash
            if block_hash is not None:
                copies.append(block_hash)
                if self._evict_cached_hash(block):
                    last.append(block_hash)
            block.ref_cnt += 1
            block.alloc_epoch += 1
        self.num_allocated_total += num_blocks
        if copies and self.enable_kv_cache_events:
            removed = BlockRemoved(block_hashes=last, medium=MEDIUM_GPU) if last else None
            if self._per_copy:
                self.kv_event_queue.append(BlockRemoved(block_hashes=copies, medium=MEDIUM_GPU))
            elif removed is not None:
                self.kv_event_queue.append(removed)
            if removed is not None:
                for listener in self.event_listeners:
                    listener(removed)
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
            cleared = AllBlocksCleared()
            self.kv_event_queue.append(cleared)
            for listener in self.event_listeners:
                listener(cleared)
        return True

    def announce_empty(self) -> None:
        """Queue ``AllBlocksCleared``: an engine's stream starts with it (see ``kvoffload.events``).

        A router that kept entries of an earlier incarnation of this instance
        (the same endpoint, restarted) drops them; what a persistent tier
        still holds is announced after it.
        """
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())

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
