"""The block pool: every KV block, the free queue, the prefix-cache hash map and KV events."""

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from engine_core.kv_cache.block import (
    BlockHash,
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from engine_core.kv_cache.free_queue import FreeKVCacheBlockQueue
from engine_core.kv_cache.hashing import block_extra_keys
from protocol.kv_cache_spec import KVCacheSpec, SlidingWindowSpec
from protocol.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_block_hash,
)

if TYPE_CHECKING:
    from engine_core.request import Request

logger = logging.getLogger(__name__)


class BlockHashToBlockMap:
    """hash+group -> blocks. Two requests may compute the same block at once, so one key can map to
    several blocks; a lookup returns any one of them."""

    def __init__(self) -> None:
        self._map: dict[BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def __len__(self) -> int:
        return len(self._map)

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        found = self._map.get(key)
        if isinstance(found, dict):
            return next(iter(found.values()))
        return found

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        found = self._map.get(key)
        if found is None:
            self._map[key] = block
        elif isinstance(found, dict):
            found[block.block_id] = block
        else:
            self._map[key] = {found.block_id: found, block.block_id: block}

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> None:
        found = self._map.pop(key)
        if isinstance(found, dict):
            del found[block_id]
            if len(found) == 1:
                self._map[key] = next(iter(found.values()))
            elif found:
                self._map[key] = found
        else:
            assert found.block_id == block_id

    def clear(self) -> None:
        self._map.clear()


def kv_cache_spec_kind(spec: KVCacheSpec) -> tuple[str, int | None]:
    """vLLM's kv_cache_spec_kind and kv_cache_spec_sliding_window of a group, for its BlockStored events."""
    if isinstance(spec, SlidingWindowSpec):
        return "sliding_window", spec.sliding_window
    return "full_attention", None


class BlockPool:
    def __init__(self, num_gpu_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False,
                 kv_cache_specs: Sequence[KVCacheSpec] = ()) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (block 0 is the null block), got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []
        # Per group id; a pool built without specs sends no spec kind.
        self.group_spec_kinds = dict(enumerate(map(kv_cache_spec_kind, kv_cache_specs)))
        self.num_cached_free_blocks = 0  # free blocks that still hold a cached prefix (for stats)
        # A second KV tier's hook (KVConnectorScheduler.on_blocks_cached): told of every block registered here.
        self.on_blocks_cached: Callable[[Request, list[KVCacheBlock], int, int, int], None] | None = None

    def get_cached_block(self, block_hash: BlockHash, kv_cache_group_ids: list[int]) -> list[KVCacheBlock] | None:
        """The cached block for this hash in every group given, or None if any group misses."""
        out = []
        for group_id in kv_cache_group_ids:
            block = self.cached_block_hash_to_block.get_one_block(make_block_hash_with_group_id(block_hash, group_id))
            if block is None:
                return None
            out.append(block)
        return out

    def cache_full_blocks(
        self,
        request: "Request",
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] of the request under their hashes."""
        stored: list[BlockHash] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:  # a sliding window dropped it: nothing to cache
                continue
            block_hash = request.block_hashes[i]
            key = make_block_hash_with_group_id(block_hash, kv_cache_group_id)
            block.block_hash = key
            self.cached_block_hash_to_block.insert(key, block)
            stored.append(block_hash)
        if self.on_blocks_cached is not None and stored:
            self.on_blocks_cached(request, blocks, num_cached_blocks, num_full_blocks, kv_cache_group_id)
        if self.enable_kv_cache_events and stored:
            first = num_full_blocks - len(stored)
            kind, window = self.group_spec_kinds.get(kv_cache_group_id, (None, None))
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=[external_block_hash(h) for h in stored],
                    parent_block_hash=external_block_hash(request.block_hashes[first - 1]) if first > 0 else None,
                    token_ids=request.all_token_ids[first * block_size : num_full_blocks * block_size],
                    block_size=block_size,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    extra_keys=[block_extra_keys(request, i) for i in range(first, num_full_blocks)],
                    group_idx=kv_cache_group_id,
                    kv_cache_spec_kind=kind,
                    kv_cache_spec_sliding_window=window,
                )
            )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the front of the free queue; a reused cached block loses its hash."""
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool ({self.get_num_free_blocks()} free)")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            key = block._block_hash
            if key is not None:
                self.num_cached_free_blocks -= 1
                self._evict_cached_block(block, key)
            block.ref_cnt = 1
        return blocks

    def _evict_cached_block(self, block: KVCacheBlock, key: BlockHashWithGroupId) -> None:
        """key: the block's hash, which the caller has checked is set."""
        self.cached_block_hash_to_block.pop(key, block.block_id)
        block.reset_hash()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(
                    block_hashes=[external_block_hash(get_block_hash(key))], medium=MEDIUM_GPU, group_idx=get_group_id(key)
                )
            )

    def touch(self, blocks: Iterable[list[KVCacheBlock]]) -> None:
        """Take a reference on prefix-cache hits; a hit that was free leaves the free queue."""
        for group in blocks:
            for block in group:
                if block.is_null:
                    continue
                if block.ref_cnt == 0:
                    self.free_block_queue.remove(block)
                    self.num_cached_free_blocks -= block._block_hash is not None
                block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each. Blocks reaching 0 go to the front if uncached, to the back if cached."""
        front: list[KVCacheBlock] = []
        back: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (front if block._block_hash is None else back).append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
        self.free_block_queue.prepend_n(front)
        self.free_block_queue.append_n(back)
        self.num_cached_free_blocks += len(back)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop these blocks' prefix-cache entries (their data is gone or stale); ownership is unchanged."""
        for block_id in block_ids:
            if not 0 < block_id < self.num_gpu_blocks:
                raise ValueError(f"block id {block_id} is outside 1..{self.num_gpu_blocks - 1}")
            block = self.blocks[block_id]
            key = block._block_hash
            if key is not None:
                self.num_cached_free_blocks -= block.ref_cnt == 0
                self._evict_cached_block(block, key)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False, with a warning) while any block is in use."""
        num_used = self.num_gpu_blocks - 1 - self.get_num_free_blocks()
        if num_used > 0:
            logger.warning("Failed to reset the prefix cache: %d blocks are still in use by requests", num_used)
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.reset_hash()
        self.num_cached_free_blocks = 0
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        logger.info("Prefix cache reset")
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Share of usable blocks outside the free queue (cached-but-free blocks count as free)."""
        return 1.0 - self.get_num_free_blocks() / (self.num_gpu_blocks - 1)

    def take_events(self) -> list[KVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
