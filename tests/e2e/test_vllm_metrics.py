"""A real server's /metrics carries vLLM's series with the served model's name, equal to kvengine's own."""

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import wait_until
from tests.e2e.serve_support import GREEDY, SMALL, free_port, generate_all, prompts


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_vllm_series_name_the_served_model(start_server):
    port = free_port()
    server = start_server("--metrics-port", str(port), "--served-model-name", "my-model", *SMALL)
    asyncio.run(server.wait_ready())
    batch = prompts(6, seed=21)
    asyncio.run(generate_all(server.address, batch))
    labels = (("engine", "0"), ("model_name", "my-model"))
    generated = 6 * GREEDY.max_tokens

    def settled() -> dict | None:
        got = scrape(port)
        return got if got.get(("vllm:generation_tokens_total", labels)) == generated else None

    assert wait_until(settled)
    got = scrape(port)
    assert got[("vllm:prompt_tokens_total", labels)] == got[("kvengine:prompt_tokens_total", ())] == sum(map(len, batch))
    assert got[("vllm:num_requests_running", labels)] == 0
    assert got[("vllm:time_to_first_token_seconds_count", labels)] == 6
    assert got[("vllm:inter_token_latency_seconds_count", labels)] == 6 * (GREEDY.max_tokens - 1)
    assert got[("vllm:e2e_request_latency_seconds_count", labels)] == 6
    assert got[("vllm:request_success_total", tuple(sorted((*labels, ("finished_reason", "length")))))] == 6
    assert got[("vllm:prefix_cache_queries_total", labels)] == got[("kvengine:prefix_cache_queries_total", ())]
