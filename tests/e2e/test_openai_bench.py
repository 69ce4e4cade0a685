"""`kvengine bench --backend openai` drives an OpenAI-compatible server over HTTP with the same workloads."""

import json
import os

from tests.e2e.openai_server import SMALL, start_api_server

SMALL_BENCH = ["--num-prompts", "6", "--input-len", "24", "--output-len", "5", "--max-concurrency", "3"]


def test_bench_over_http_reports_the_same_table(start_server, start_command):
    api = start_api_server(start_server, *SMALL)
    for workload in ("random", "multi-turn"):
        proc = start_command("bench", "--backend", "openai", "--base-url", api.base_url, "--workload", workload,
                             "--turns", "2", "--json", *SMALL_BENCH)
        assert proc.wait() == 0, proc.stderr()
        summary = json.loads(proc.stdout())
        turns = 2 if workload == "multi-turn" else 1
        assert summary["failed"] == 0 and summary["output_tokens"] == 6 * 5 * turns
        assert summary["prefix_cache_hit_rate"] is None and summary["ttft_ms"]["p50"] > 0


def test_bench_openai_needs_a_base_url(start_command):
    proc = start_command("bench", "--backend", "openai")
    assert proc.wait() == 2 and "--base-url" in proc.stderr()


def test_bench_openai_says_when_no_server_answers(start_command):
    proc = start_command("bench", "--backend", "openai", "--base-url", "http://127.0.0.1:9", *SMALL_BENCH)
    assert proc.wait() == 1 and "kvengine bench:" in proc.stderr() and "Traceback" not in proc.stderr()


def test_bench_over_http_sends_the_api_key(start_server, start_command):
    api = start_api_server(start_server, *SMALL, "--api-key", "k-bench")
    args = ["bench", "--backend", "openai", "--base-url", api.base_url, "--json", *SMALL_BENCH]
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    refused = start_command(*args, env=env)
    assert refused.wait() == 1 and "401" in refused.stderr()
    proc = start_command(*args, "--api-key", "k-bench")
    assert proc.wait() == 0, proc.stderr()
    assert json.loads(proc.stdout())["failed"] == 0
