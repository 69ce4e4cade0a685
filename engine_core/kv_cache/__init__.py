"""The KV block ledger: which blocks exist, who holds them, which are cached. No tensors here."""

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from engine_core.kv_cache.free_queue import FreeKVCacheBlockQueue
from engine_core.kv_cache.hashing import get_hash_fn, get_request_block_hasher, hash_block_tokens
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager, PrefixCacheStats
from engine_core.kv_cache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
)
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

__all__ = [
    "BlockPool",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "HybridKVCacheCoordinator",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheGroupSpec",
    "KVCacheManager",
    "PrefixCacheStats",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "UnitaryKVCacheCoordinator",
    "get_hash_fn",
    "get_kv_cache_coordinator",
    "get_request_block_hasher",
    "hash_block_tokens",
]
