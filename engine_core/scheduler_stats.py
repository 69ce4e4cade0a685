"""The scheduler's snapshot for logs and metrics: O(running requests), cheap enough several times a second on a
large pool."""

from typing import TYPE_CHECKING

from protocol import SchedulerStats

if TYPE_CHECKING:
    from engine_core.scheduler import Scheduler


def make_scheduler_stats(scheduler: "Scheduler") -> SchedulerStats:
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    prefix = manager.prefix_cache_stats
    # Only running requests hold blocks, and only a request's last block per group can be partial
    # (prefix hits are full blocks), so held blocks and stored tokens follow without a walk.
    held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
    partial_fills = [
        r.num_computed_tokens % scheduler.block_size
        for r in scheduler.running
        for _ in range(manager.num_kv_cache_groups)
        if r.num_computed_tokens % scheduler.block_size
    ]
    loading = scheduler.tier_loads
    spec = scheduler.spec
    stats = SchedulerStats(
        num_running_reqs=len(scheduler.running),
        num_waiting_reqs=len(scheduler.waiting) + (0 if loading is None else len(loading.requests)),
        kv_cache_usage=manager.get_usage(),
        num_free_blocks=pool.get_num_free_blocks(),
        num_blocks_held=held,
        num_cached_free_blocks=pool.num_cached_free_blocks,
        num_tokens_stored=(held - len(partial_fills)) * scheduler.block_size + sum(partial_fills),
        prefix_cache_queries=prefix.queries,
        prefix_cache_hits=prefix.hits,
        num_preemptions=scheduler.num_preemptions,
        num_prompt_tokens=scheduler.num_prompt_tokens,
        num_generation_tokens=scheduler.num_generation_tokens,
        step=scheduler.step,
    )
    if spec is not None:
        stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
        stats.spec_decode_num_accepted_tokens = spec.num_accepted_tokens
        stats.spec_decode_num_accepted_tokens_per_pos = list(spec.accepted_per_pos)
    return stats
