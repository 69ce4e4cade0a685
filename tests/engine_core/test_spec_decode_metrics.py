"""Speculative decoding's counters under vLLM's names and labels, and the acceptance rate in the stats log line."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_core.metrics import EngineMetrics
from engine_core.stats_log import format_stats_line
from protocol import SchedulerStats

LABELS = {"model_name": "m", "engine": "0"}


def _samples(metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _stats(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> SchedulerStats:
    return SchedulerStats(spec_decode_num_drafts=drafts, spec_decode_num_draft_tokens=draft_tokens,
                          spec_decode_num_accepted_tokens=accepted, spec_decode_num_accepted_tokens_per_pos=per_pos)


def test_counters_follow_the_totals_by_position():
    metrics = EngineMetrics(16, "m")
    metrics.update_stats(SchedulerStats())  # no --speculative-config: no series
    assert not any("spec_decode" in name for name, _ in _samples(metrics))
    metrics.update_stats(_stats(2, 6, 3, [2, 1, 0]))
    metrics.update_stats(_stats(5, 15, 7, [4, 2, 1]))
    got = _samples(metrics)
    key = tuple(sorted(LABELS.items()))
    assert got[("vllm:spec_decode_num_drafts_total", key)] == 5
    assert got[("vllm:spec_decode_num_draft_tokens_total", key)] == 15
    assert got[("vllm:spec_decode_num_accepted_tokens_total", key)] == 7
    for p, v in enumerate([4, 2, 1]):
        pos = tuple(sorted({**LABELS, "position": str(p)}.items()))
        assert got[("vllm:spec_decode_num_accepted_tokens_per_pos_total", pos)] == v
        assert got[("kvengine:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(p)),))] == v
    assert got[("kvengine:spec_decode_num_accepted_tokens_total", ())] == 7


def test_stats_line_gives_the_intervals_acceptance_rate():
    line = format_stats_line(_stats(5, 15, 7, [4, 2, 1]), _stats(2, 6, 3, [2, 1, 0]), 1.0)
    assert line.endswith("Spec decode draft acceptance rate: 44.4%, mean acceptance length: 2.33")
    assert "Spec decode" not in format_stats_line(SchedulerStats(), SchedulerStats(), 1.0)
