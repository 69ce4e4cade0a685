"""Metrics scraped from a real server, checked against what the client saw; the bench's plot."""

import asyncio
import json
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from launch.client import AsyncEngineClient
from protocol import SamplingParams
from tests.e2e.serve_support import free_port, prompts


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


async def run_workload(address: str, port: int, batch: list[list[int]], params: SamplingParams):
    """Run the batch, scraping once while it runs; then wait until the metrics settle."""
    async with AsyncEngineClient(address) as client:
        async def one(prompt):
            tokens, cached, reason = [], 0, None
            async for out in client.generate(prompt, params):
                tokens += out.new_token_ids
                cached, reason = out.num_cached_tokens, out.finish_reason
            return tokens, cached, reason

        tasks = [asyncio.create_task(one(p)) for p in batch]
        during = None
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
            m = await asyncio.to_thread(scrape, port)
            if m["kvengine:num_requests_running"] > 0:
                during = m
        results = [t.result() for t in tasks]
        stats = await client.get_stats()
        for _ in range(50):
            after = await asyncio.to_thread(scrape, port)
            if after["kvengine:generation_tokens_total"] == stats.num_generation_tokens:
                break
            await asyncio.sleep(0.1)
        return results, during, after, stats


def test_metrics_agree_with_what_the_client_saw(start_server):
    port = free_port()
    server = start_server("--max-model-len", "512", "--kv-cache-memory-bytes", "16MiB", "--metrics-port", str(port))
    asyncio.run(server.wait_ready())
    prefix = prompts(1, seed=3, lo=64, hi=65)[0]
    batch = [prefix + p for p in prompts(12, seed=4, lo=1, hi=30)]
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)  # long enough to scrape mid-run
    results, during, after, stats = asyncio.run(run_workload(server.address, port, batch, params))

    assert during is not None and during["kvengine:kv_cache_usage_perc"] > 0
    assert during["kvengine:kv_cache_blocks_held"] > 0
    assert 0 < during["kvengine:kv_cache_token_occupancy_perc"] <= 1
    assert after["kvengine:generation_tokens_total"] == sum(len(t) for t, _, _ in results) == 12 * 300
    assert after['kvengine:request_success_total{finished_reason=length}'] == 12
    assert after["kvengine:prompt_tokens_total"] == sum(len(p) for p in batch)
    cached = sum(c for _, c, _ in results)
    assert cached >= 11 * 64  # every request after the first finds the shared 64-token prefix
    assert after["kvengine:prefix_cache_hits_total"] == cached  # no preemption here: one admission each
    assert after["kvengine:prefix_cache_queries_total"] == sum(len(p) for p in batch)
    assert after["kvengine:num_requests_running"] == 0 and after["kvengine:kv_cache_usage_perc"] == 0
    assert after["kvengine:kv_cache_blocks_cached_free"] > 0
    assert after["kvengine:time_to_first_token_seconds_count"] == 12
    assert after["kvengine:inter_token_latency_seconds_count"] == 12 * 299
    assert stats.num_preemptions == 0


def test_preemptions_under_a_small_pool_are_counted(start_server):
    port = free_port()
    # 24 blocks of 16 tokens at 32 KiB each (built-in model, TP 1): a handful of long requests must preempt.
    server = start_server("--max-model-len", "256", "--num-gpu-blocks-override", "24", "--metrics-port", str(port))
    asyncio.run(server.wait_ready())
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    results, _, after, stats = asyncio.run(run_workload(server.address, port, prompts(6, seed=8, lo=60, hi=90), params))
    assert all(reason == "length" and len(t) == 150 for t, _, reason in results)
    assert stats.num_preemptions > 0
    assert after["kvengine:num_preemptions_total"] == stats.num_preemptions


def test_bench_plot_is_a_png_with_the_four_series(tmp_path):
    out = tmp_path / "run.png"
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "bench", "--num-prompts", "6", "--input-len", "64", "--output-len", "24",
         "--num-gpu-blocks-override", "12", "--max-model-len", "128", "--plot", str(out), "--stats-period", "0.1",
         "--json", "--server-log", str(tmp_path / "server.log")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["requests"] == 6 and summary["failed"] == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_the_four_panels(tmp_path):
    from launch.commands.plot import plot_run
    from protocol import SchedulerStats

    samples = [(0.0, SchedulerStats()), (0.5, SchedulerStats(kv_cache_usage=0.9, num_running_reqs=3, num_waiting_reqs=2,
               num_blocks_held=10, num_cached_free_blocks=1, num_preemptions=1, num_generation_tokens=50))]
    labels = plot_run(samples, str(tmp_path / "p.png"), "t")
    assert labels == [["KV cache usage"], ["held by running requests", "cached but free (evictable)"],
                      ["running", "waiting", "preemptions"], ["generation", "prompt"]]


def test_kvengine_events_prints_the_servers_batches_including_missed_ones(start_server, tmp_path):
    events, replay = f"ipc://{tmp_path}/events", f"ipc://{tmp_path}/replay"
    server = start_server("--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB",
                          "--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay)
    asyncio.run(server.wait_ready())
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    async def run(batch):
        async with AsyncEngineClient(server.address) as client:
            for prompt in batch:  # one at a time: each stores its prompt's full blocks
                async for _ in client.generate(prompt, params):
                    pass

    asyncio.run(run(prompts(3, seed=11, lo=40, hi=60)))  # before any subscriber: must come from the replay
    sub = subprocess.Popen([sys.executable, "-m", "launch.cli", "events", events, "--replay-endpoint", replay,
                            "--count", "5", "--json"], stdout=subprocess.PIPE, text=True)
    try:
        for _ in range(20):  # keep publishing until the late subscriber has joined and caught up
            asyncio.run(run(prompts(1, seed=12 + _, lo=40, hi=60)))
            if sub.poll() is not None:
                break
        out, _ = sub.communicate(timeout=60)
    finally:
        if sub.poll() is None:
            sub.kill()
    batches = [json.loads(line) for line in out.splitlines()]
    assert [b["seq"] for b in batches] == [0, 1, 2, 3, 4]  # seq from 0: the missed ones were replayed
    events = [event for b in batches for event in b["events"]]
    assert events and all(event["type"] == "BlockStored" for event in events)
    assert all(event["medium"] == "GPU" and event["group_idx"] == 0 and event["lora_id"] is None for event in events)
    assert all(len(event["token_ids"]) == 16 * len(event["block_hashes"]) for event in events)
