"""Prometheus counters of the second KV tiers (kvengine:kv_tier_*, labelled by medium, "DISK" for the disk tier):
hits, loads, saves and their bytes, from each tier's KVTierStats. The memory tier's hits are the prefix-cache
series; a prompt token counts in one of the two, never both."""

from prometheus_client import CollectorRegistry, Counter

from protocol.kv_transfer import KVTierStats

# KVTierStats field -> (series, help)
SERIES = {
    "hits": ("kv_tier_hits", "Prompt tokens loaded from the tier beyond the memory prefix hit, at admission"),
    "loaded_blocks": ("kv_tier_loaded_blocks", "KV blocks loaded from the tier"),
    "load_bytes": ("kv_tier_load_bytes", "Bytes read from the tier"),
    "saved_blocks": ("kv_tier_saved_blocks", "KV blocks written to the tier"),
    "save_bytes": ("kv_tier_save_bytes", "Bytes written to the tier"),
    "failed_blocks": ("kv_tier_failed_blocks", "KV blocks missing or corrupt when loaded (recomputed)"),
    "removed_blocks": ("kv_tier_removed_blocks", "KV blocks the tier dropped (evicted for room, or corrupt)"),
}


class KVTierMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.counters = {field: Counter("kvengine:" + name, doc, ["medium"], registry=registry)
                         for field, (name, doc) in SERIES.items()}
        self._last: dict[str, KVTierStats] = {}  # medium -> the totals last exported

    def update(self, tiers: list[KVTierStats]) -> None:
        """Each tier's totals since start-up; the counters grow by what is new."""
        for stats in tiers:
            last = self._last.get(stats.medium) or KVTierStats(medium=stats.medium)
            for field, counter in self.counters.items():
                counter.labels(stats.medium).inc(getattr(stats, field) - getattr(last, field))
            self._last[stats.medium] = stats
