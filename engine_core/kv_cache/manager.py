"""KVCacheManager: the ledger API the scheduler calls."""

from dataclasses import dataclass

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.coordinator import get_kv_cache_coordinator
from engine_core.kv_cache.single_type_manager import FullAttentionManager
from engine_core.request import Request, RequestStatus
from protocol.kv_cache_spec import KVCacheConfig
from protocol.kv_events import KVCacheEvent


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks of one request or one call: one list per KV cache group."""

    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> list[list[int]]:
        return [[block.block_id for block in group] for group in self.blocks]

    def num_new_blocks(self) -> int:
        return sum(len(group) for group in self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    """Counted in tokens at admission: a query is a request's tokens looked up, a hit the tokens found.
    A request that waits and retries is counted once, when it is admitted. Totals since start-up."""

    requests: int = 0
    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """The ledger the scheduler calls: each request's blocks per KV cache group, prefix-cache hits, free blocks.

    One request's tokens as allocate_slots sees them (a, b, c, d are token counts from its start):

        0              a                   b                  c                   d
        |   computed   |   new computed    |       new        |     lookahead     |
        +--------------+-------------------+------------------+-------------------+
          blocks held    prefix-cache hits   tokens computed    slots reserved for
          already        adopted now         this step          later, no tokens yet

        a = request.num_computed_tokens
        b = a + num_new_computed_tokens      (their blocks: new_computed_blocks)
        c = b + num_new_tokens
        d = c + num_lookahead_tokens

    Blocks must cover [0, min(d, max_model_len)): computed blocks are held already, the new computed
    blocks are adopted (a new request only), and new blocks come from the free queue for the rest.
    First, blocks wholly before the sliding window of token b (num_skipped_blocks) become the null block.
    Full blocks up to min(c, request.num_tokens) are hash-registered; lookahead slots are not.
    With full_sequence_must_fit (admission), the whole request up to min(request.num_tokens,
    max_model_len) must fit as well.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        max_num_batched_tokens: int | None = None,
        watermark: float = 0.0,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config, max_num_batched_tokens or max_model_len, enable_caching, enable_kv_cache_events
        )
        self.block_pool = self.coordinator.block_pool
        self.prefix_cache_stats = PrefixCacheStats()
        # All groups share one block size (the hybrid coordinator checks it); hashes are made at it.
        groups = kv_cache_config.kv_cache_groups
        self.hash_block_size = groups[0].kv_cache_spec.block_size if groups else 0
        self._no_blocks: tuple[list[KVCacheBlock], ...] = tuple([] for _ in range(self.num_kv_cache_groups))
        self._no_new_blocks = KVCacheBlocks(self._no_blocks)  # most decode steps' answer, built once
        managers = self.coordinator.single_type_managers
        self._full_only = managers[0] if len(managers) == 1 and isinstance(managers[0], FullAttentionManager) else None

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's longest prefix-cache hit, never its whole prompt: the last token is always computed.
        A request that asks for prompt log-probabilities gets none (as in vLLM): they come from computing it."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return KVCacheBlocks(self._no_blocks), 0
        self._check_block_hashes(request)
        max_cache_hit_length = request.num_tokens - 1
        hits, num_hit_tokens = self.coordinator.find_longest_cache_hit(request.block_hashes, max_cache_hit_length)
        return KVCacheBlocks(hits), num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = False,
        delay_cache_blocks: bool = False,
    ) -> KVCacheBlocks | None:
        """Blocks for num_new_tokens more tokens (the spans: the class docstring). Counts first: on None nothing
        has changed. Returns only the blocks new to this call (for a new request, get_blocks() has all of them).
        delay_cache_blocks: register no new block yet (a second tier loads them; registered once loaded)."""
        if num_new_tokens == 0 and num_new_computed_tokens == 0:
            raise ValueError(f"allocate_slots for {request.request_id} with no new and no computed tokens")
        if new_computed_blocks is None and self._fits_in_held_blocks(request, num_new_tokens, num_lookahead_tokens):
            return self._no_new_blocks
        if self.enable_caching:
            self._check_block_hashes(request)
        hits = new_computed_blocks.blocks if new_computed_blocks is not None else self._no_blocks
        num_computed_tokens = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)

        # The watermark keeps headroom only against new admissions while others run.
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            watermark_blocks = self.watermark_blocks
        if full_sequence_must_fit and not self._full_sequence_fits(request, hits, watermark_blocks):
            return None

        num_tokens_need_slot = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        # Dropping blocks that left a window may free some; legal even if we then return None.
        self.coordinator.remove_skipped_blocks(request.request_id, num_computed_tokens)
        needed = self.coordinator.get_num_blocks_to_allocate(request.request_id, num_tokens_need_slot, hits)
        if needed + watermark_blocks > self.block_pool.get_num_free_blocks():
            return None

        if new_computed_blocks is not None and any(hits):
            self.coordinator.save_new_computed_blocks(request.request_id, hits)
        new_blocks = self.coordinator.allocate_new_blocks(request.request_id, num_tokens_need_slot)
        if self.enable_caching:  # lookahead slots hold no real tokens yet
            if not delay_cache_blocks:
                self.coordinator.cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
            if new_computed_blocks is not None:  # an admission: count its lookup once, not per retry
                stats = self.prefix_cache_stats
                stats.requests += 1
                stats.queries += request.num_tokens
                stats.hits += num_new_computed_tokens
        return KVCacheBlocks(new_blocks)

    def _full_sequence_fits(
        self, request: Request, hits: tuple[list[KVCacheBlock], ...], watermark_blocks: int
    ) -> bool:
        """Admission: the whole sequence up to min(request.num_tokens, max_model_len), not just this chunk."""
        full_num_tokens = min(request.num_tokens, self.max_model_len)
        needed = self.coordinator.get_num_blocks_to_allocate(
            request.request_id, full_num_tokens, hits, apply_admission_cap=True
        )
        return needed + watermark_blocks <= self.block_pool.get_num_free_blocks()

    def _fits_in_held_blocks(self, request: Request, num_new_tokens: int, num_lookahead_tokens: int) -> bool:
        """Most decode steps: one full-attention group, the new slots lie in blocks already held and no
        block becomes full, so the general path would change nothing."""
        manager = self._full_only
        if manager is None:
            return False
        blocks = manager.req_to_blocks.get(request.request_id)
        if blocks is None:
            return False
        block_size = manager.block_size
        end = request.num_computed_tokens + num_new_tokens
        if end + num_lookahead_tokens > len(blocks) * block_size:
            return False
        if not self.enable_caching:
            return True
        num_tokens = len(request.all_token_ids)
        num_full = min(num_tokens, end) // block_size
        return num_full <= manager.num_cached_block.get(request.request_id, 0)

    def _check_block_hashes(self, request: Request) -> None:
        """Hashes made at another block size would register blocks under keys of other token spans
        (false hits that reuse another prompt's KV); refuse before anything changes."""
        if len(request.block_hashes) != request.num_tokens // self.hash_block_size:
            raise ValueError(
                f"request {request.request_id} has {len(request.block_hashes)} block hashes for "
                f"{request.num_tokens} tokens; with prefix caching its hashes must be made at the KV cache "
                f"block size {self.hash_block_size} (get_request_block_hasher({self.hash_block_size}, ...))"
            )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Hash-register the blocks that num_computed_tokens fills (async scheduling: once their tokens are known)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        self.coordinator.free(request.request_id)

    def holds_blocks(self, request_id: str) -> bool:
        return any(self.coordinator.get_blocks(request_id))

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        return self.get_blocks(request_id).get_block_ids()

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_usage(self) -> float:
        return self.block_pool.get_usage()

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()
