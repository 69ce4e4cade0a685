"""The periodic stats log line of a busy server."""

import logging
import time

from protocol import SchedulerStats

logger = logging.getLogger("kvengine.stats")


class StatsLogger:
    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.last_time = time.monotonic()
        self.last = SchedulerStats()

    def maybe_log(self, stats: SchedulerStats) -> None:
        """Log a line per interval while steps happen; stay quiet while idle."""
        now = time.monotonic()
        if now - self.last_time < self.interval:
            return
        if stats.step != self.last.step:
            logger.info(format_stats_line(stats, self.last, now - self.last_time))
        self.last, self.last_time = stats, now


def format_stats_line(now: SchedulerStats, before: SchedulerStats, seconds: float) -> str:
    queries = now.prefix_cache_queries - before.prefix_cache_queries
    hits = now.prefix_cache_hits - before.prefix_cache_hits
    return (
        f"Avg prompt throughput: {(now.num_prompt_tokens - before.num_prompt_tokens) / seconds:.1f} tokens/s, "
        f"Avg generation throughput: {(now.num_generation_tokens - before.num_generation_tokens) / seconds:.1f} "
        f"tokens/s, Running: {now.num_running_reqs} reqs, Waiting: {now.num_waiting_reqs} reqs, "
        f"KV cache usage: {now.kv_cache_usage:.1%}, Prefix cache hit rate: {hits / queries if queries else 0:.1%}, "
        f"Preemptions: {now.num_preemptions - before.num_preemptions}{_spec_decode(now, before)}"
    )


def _spec_decode(now: SchedulerStats, before: SchedulerStats) -> str:
    """--speculative-config: the interval's draft acceptance rate and tokens per verifying step (vLLM's figures)."""
    if not now.spec_decode_num_accepted_tokens_per_pos:
        return ""
    drafts = now.spec_decode_num_drafts - before.spec_decode_num_drafts
    draft_tokens = now.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = now.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return (f", Spec decode draft acceptance rate: {accepted / draft_tokens if draft_tokens else 0:.1%}, "
            f"mean acceptance length: {1 + accepted / drafts if drafts else 0:.2f}")
