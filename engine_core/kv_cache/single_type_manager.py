"""Per-attention-type block rules: one manager per KV cache group, all on one shared BlockPool."""

from typing import TYPE_CHECKING

from engine_core.kv_cache.block import BlockHash, KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    max_sliding_window_blocks,
    num_skipped_blocks,
)
from protocol.sizes import cdiv

if TYPE_CHECKING:
    from engine_core.request import Request


class SingleTypeKVCacheManager:
    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.null_block = block_pool.null_block
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}  # leading blocks of a request already in the hash map
        # Most blocks one request can hold at once; None means no cap beyond its length.
        self.max_admission_blocks_per_request: int | None = None

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: list[KVCacheBlock],
        apply_admission_cap: bool = False,
    ) -> int:
        """Free-queue blocks that holding num_tokens would consume (prefix hits that are free count too)."""
        num_required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            num_required = min(num_required, self.max_admission_blocks_per_request)
        held = self.req_to_blocks.get(request_id)
        if held is not None:  # a running request has no new prefix hits
            return max(num_required - len(held), 0)
        real_hits = [b for b in new_computed_blocks if not b.is_null]
        num_evictable_hits = sum(1 for b in real_hits if b.ref_cnt == 0)
        # Null hits (a sliding window's dropped blocks) hold nothing; with the cap, only real blocks count.
        num_positions = len(real_hits) if apply_admission_cap else len(new_computed_blocks)
        return max(num_required - num_positions, 0) + num_evictable_hits

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: list[KVCacheBlock]) -> None:
        """Adopt a new request's prefix hits as the start of its block list."""
        assert request_id not in self.req_to_blocks, f"request {request_id} already holds blocks"
        self.block_pool.touch([new_computed_blocks])
        self.req_to_blocks[request_id] = list(new_computed_blocks)
        self.num_cached_block[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: "Request", num_tokens: int) -> None:
        """Hash-register the request's blocks that num_tokens fills."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks[rid], num_cached, num_full, self.block_size, self.kv_cache_group_id
        )
        self.num_cached_block[rid] = num_full

    def free(self, request_id: str) -> None:
        """Give the blocks back tail first, so a cached prefix is evicted from its end."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(blocks))

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks no future token attends to. Full attention keeps everything."""

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: list[BlockHash],
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
    ) -> tuple[list[KVCacheBlock], ...]:
        raise NotImplementedError


class FullAttentionManager(SingleTypeKVCacheManager):
    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec):
        """The longest run of cached blocks from the start; every group must hit."""
        hits: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        for block_hash in block_hashes[: max_length // kv_cache_spec.block_size]:
            cached = block_pool.get_cached_block(block_hash, kv_cache_group_ids)
            if cached is None:
                break
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits.append(block)
        return hits


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: SlidingWindowSpec, block_pool: BlockPool, kv_cache_group_id: int,
                 max_num_batched_tokens: int) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id)
        self.sliding_window = kv_cache_spec.sliding_window
        self.max_admission_blocks_per_request = max_sliding_window_blocks(
            self.sliding_window, self.block_size, max_num_batched_tokens
        )

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec):
        """A hit needs only the last window of blocks before its end; earlier ones become null blocks.

        Searches from the right for cdiv(window - 1, block_size) contiguous cached blocks.
        """
        block_size = kv_cache_spec.block_size
        needed = cdiv(kv_cache_spec.sliding_window - 1, block_size)
        max_num_blocks = max_length // block_size
        hits = tuple([block_pool.null_block] * max_num_blocks for _ in kv_cache_group_ids)
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            for group_hits, block in zip(hits, cached, strict=True):
                group_hits[i] = block
            run += 1
            if run >= needed:
                for group_hits in hits:
                    del group_hits[i + run :]
                return hits
        # No full window anywhere: only a run that starts at block 0 is usable.
        for group_hits in hits:
            del group_hits[run:]
        return hits

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace blocks wholly before the window of the next token by the null block, and free them."""
        first_useful_block = num_skipped_blocks(num_computed_tokens, self.sliding_window, self.block_size)
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        removed = []
        for i in range(min(first_useful_block, len(blocks)) - 1, -1, -1):
            if blocks[i].is_null:  # everything before was dropped earlier
                break
            removed.append(blocks[i])
            blocks[i] = self.null_block
        self.block_pool.free_blocks(removed)


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpec, block_pool: BlockPool, kv_cache_group_id: int, max_num_batched_tokens: int
) -> SingleTypeKVCacheManager:
    if isinstance(kv_cache_spec, SlidingWindowSpec):
        return SlidingWindowManager(kv_cache_spec, block_pool, kv_cache_group_id, max_num_batched_tokens)
    if isinstance(kv_cache_spec, FullAttentionSpec):
        return FullAttentionManager(kv_cache_spec, block_pool, kv_cache_group_id)
    raise TypeError(f"no manager for KV cache spec {type(kv_cache_spec).__name__}")


MANAGER_CLASS = {FullAttentionSpec: FullAttentionManager, SlidingWindowSpec: SlidingWindowManager}
