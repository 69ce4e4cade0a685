"""vLLM's series beside kvengine's: names, labels, buckets and values a vLLM dashboard or autoscaler reads."""

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine_core.metrics import EngineMetrics
from engine_core.vllm_metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS
from protocol import EngineCoreOutput, SchedulerStats

LABELS = {"model_name": "smollm2", "engine": "0"}


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(got: dict, name: str, **extra: str) -> float:
    return got[(name, tuple(sorted({**LABELS, **extra}.items())))]


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics(block_size=16, model_name="smollm2")


def test_gauges_and_counters_under_vllms_names_equal_ours(metrics):
    metrics.update_stats(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5,
                                        prefix_cache_queries=100, prefix_cache_hits=32, num_preemptions=1,
                                        num_prompt_tokens=100, num_generation_tokens=7))
    metrics.update_stats(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=150,
                                        prefix_cache_hits=48, num_preemptions=1, num_prompt_tokens=150,
                                        num_generation_tokens=20))
    got = samples(metrics)
    expected = {"vllm:num_requests_running": 1, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0.25,
                "vllm:prefix_cache_queries_total": 150, "vllm:prefix_cache_hits_total": 48,
                "vllm:num_preemptions_total": 1, "vllm:prompt_tokens_total": 150, "vllm:generation_tokens_total": 20}
    for name, v in expected.items():
        assert value(got, name) == v
        assert got[(name.replace("vllm:", "kvengine:"), ())] == v


def test_latency_histograms_have_vllms_buckets_and_count_each_request(metrics):
    metrics.on_arrival("a")
    metrics.on_arrival("refused")
    metrics.on_outputs([EngineCoreOutput("a", [5])])
    metrics.on_outputs([EngineCoreOutput("a", [6]), EngineCoreOutput("refused", [], "error", error="x")])
    metrics.on_outputs([EngineCoreOutput("a", [7], "length")])
    got = samples(metrics)
    for name, buckets in (("vllm:time_to_first_token_seconds", TTFT_BUCKETS),
                          ("vllm:inter_token_latency_seconds", ITL_BUCKETS),
                          ("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS)):
        bounds = sorted(float(dict(labels)["le"]) for (n, labels) in got if n == name + "_bucket")
        assert bounds == [*buckets, float("inf")]
    assert value(got, "vllm:time_to_first_token_seconds_count") == 1
    assert value(got, "vllm:inter_token_latency_seconds_count") == 2
    assert value(got, "vllm:e2e_request_latency_seconds_count") == 1  # the refused one never ran
    assert value(got, "vllm:request_success_total", finished_reason="length") == 1
    assert value(got, "vllm:request_success_total", finished_reason="error") == 1
    assert value(got, "vllm:request_success_total", finished_reason="stop") == 0


def test_vllms_bucket_lists():
    """Transcribed from vLLM v1 (vllm/v1/metrics/loggers.py): 22 TTFT, 19 inter-token, 21 request bounds."""
    assert (len(TTFT_BUCKETS), TTFT_BUCKETS[0], TTFT_BUCKETS[-1]) == (22, 0.001, 2560.0)
    assert (len(ITL_BUCKETS), ITL_BUCKETS[0], ITL_BUCKETS[-1]) == (19, 0.01, 80.0)
    assert (len(REQUEST_LATENCY_BUCKETS), REQUEST_LATENCY_BUCKETS[0], REQUEST_LATENCY_BUCKETS[-1]) == (21, 0.3, 7680.0)
