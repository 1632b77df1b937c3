"""A request's GPU blocks on top of ``BlockPool``: prefix hits, slots, caching."""

from __future__ import annotations

from kvoffload.blocks import BlockPool, KVCacheBlock
from kvoffload.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of the prompt's leading blocks cached in the GPU tier.

        Stops one token short of the whole prompt: the last prompt token is
        always computed, since its logits give the first output token.
        """
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_blocks_needed(
        self, request: Request, num_new_tokens: int, num_hit_blocks: int = 0
    ) -> int:
        total = request.num_computed_tokens + num_new_tokens
        need = -(-total // self.block_size)
        return max(0, need - len(request.blocks) - num_hit_blocks)

    def can_allocate(self, num_blocks: int, hit_blocks: list[KVCacheBlock]) -> bool:
        # Hit blocks that are free leave the free queue when touched.
        free_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        return num_blocks <= self.pool.get_num_free_blocks() - free_hits

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit_blocks: list[KVCacheBlock] | None = None,
    ) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens; False if no room.

        ``hit_blocks`` (first admission only) are prefix-hit blocks to take first.
        Nothing changes when it returns False.
        """
        hit_blocks = hit_blocks or []
        need = self.num_blocks_needed(request, num_new_tokens, len(hit_blocks))
        if not self.can_allocate(need, hit_blocks):
            return False
        if hit_blocks:
            self.pool.touch(hit_blocks)
            request.blocks.extend(hit_blocks)
            request.num_cached_blocks = len(request.blocks)
        if need:
            request.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register blocks whose KV is now fully computed in the prefix cache."""
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        if num_full > request.num_cached_blocks:
            self.pool.cache_full_blocks(
                request.blocks,
                request.block_hashes,
                request.num_cached_blocks,
                num_full,
                self.block_size,
                request.all_token_ids,
                lora_name=request.lora_name,
                cache_salt=request.cache_salt,
            )
            request.num_cached_blocks = num_full

    def free(self, request: Request) -> None:
        """Give back the request's blocks, tail first (see ``BlockPool``)."""
        self.pool.free_request_blocks(request.blocks)
        request.blocks = []
        request.num_cached_blocks = 0
