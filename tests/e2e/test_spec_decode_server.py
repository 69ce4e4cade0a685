"""kvengine serve --speculative-config over real sockets: the same greedy tokens as a server without it, and
vLLM's spec_decode counters on the metrics endpoint."""

import asyncio
import urllib.request

from protocol import SamplingParams
from tests.e2e.conftest import wait_until
from tests.e2e.serve_support import FP32, SMALL, free_port, generate_all

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
BATCH = [[5, 6, 7, 8] * 6, [11, 12, 13] * 5 + [11], [40, 41, 42, 43, 44]]


def _counter(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_speculative_server_matches_plain_and_counts_drafts(start_server):
    plain = start_server(*SMALL, *FP32)
    asyncio.run(plain.wait_ready())
    expected = [tokens for tokens, _ in asyncio.run(generate_all(plain.address, BATCH, PARAMS))]
    port = free_port()
    spec = start_server(*SMALL, *FP32, "--speculative-config", NGRAM, "--metrics-port", str(port))
    asyncio.run(spec.wait_ready())
    got = [tokens for tokens, _ in asyncio.run(generate_all(spec.address, BATCH, PARAMS))]
    assert got == expected

    def scrape() -> str:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()

    assert wait_until(lambda: _counter(scrape(), "vllm:spec_decode_num_drafts_total") > 0)
    text = scrape()
    accepted = _counter(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert accepted == _counter(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total")
    assert accepted <= _counter(text, "vllm:spec_decode_num_draft_tokens_total")
    assert 'position="3"' in text
