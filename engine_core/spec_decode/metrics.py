"""Speculative decoding's Prometheus series: vLLM's spec_decode counters under its names and labels (the draft
position as label position, from 0), and kvengine's own beside them. Made with the first stats that carry them,
so a server without --speculative-config has none (as vLLM)."""

from prometheus_client import CollectorRegistry, Counter

from protocol import SchedulerStats

SERIES = (("num_drafts", "Number of spec decoding drafts."),
          ("num_draft_tokens", "Number of draft tokens."),
          ("num_accepted_tokens", "Number of accepted tokens."))


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str], num_positions: int) -> None:
        names = list(labels)
        self.counters = [
            (field, Counter(f"vllm:spec_decode_{field}", doc, names, registry=registry).labels(**labels),
             Counter(f"kvengine:spec_decode_{field}", doc, registry=registry))
            for field, doc in SERIES
        ]
        doc = "Accepted tokens per draft position."
        vllm_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", doc, [*names, "position"],
                           registry=registry)
        ours_pos = Counter("kvengine:spec_decode_num_accepted_tokens_per_pos", doc, ["position"], registry=registry)
        self.per_pos = [(vllm_pos.labels(**labels, position=str(p)), ours_pos.labels(position=str(p)))
                        for p in range(num_positions)]

    def update(self, stats: SchedulerStats, last: SchedulerStats) -> None:
        for field, vllm_counter, ours in self.counters:
            delta = getattr(stats, f"spec_decode_{field}") - getattr(last, f"spec_decode_{field}")
            vllm_counter.inc(delta)
            ours.inc(delta)
        before = last.spec_decode_num_accepted_tokens_per_pos
        for p, (vllm_counter, ours) in enumerate(self.per_pos):
            delta = stats.spec_decode_num_accepted_tokens_per_pos[p] - (before[p] if p < len(before) else 0)
            vllm_counter.inc(delta)
            ours.inc(delta)
