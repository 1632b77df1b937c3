"""The GPU-tier block pool: blocks, the intrusive free queue, the prefix cache."""

from kvoffload.blocks.block_pool import BlockPool
from kvoffload.blocks.free_queue import FreeKVCacheBlockQueue
from kvoffload.blocks.kv_cache_block import KVCacheBlock

__all__ = ["BlockPool", "FreeKVCacheBlockQueue", "KVCacheBlock"]
