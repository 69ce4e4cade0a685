"""kvengine simulate: trace parsing and token synthesis (the engine's block hashes see the trace's sharing)."""

import json

import pytest

from engine_core.kv_cache.hashing import get_hash_fn, hash_block_tokens
from launch.simulate.tokens import TokenSynthesizer
from launch.simulate.trace import TraceError, TraceRequest, parse_trace_lines


def test_parse_orders_by_timestamp_and_checks_block_count():
    lines = [
        json.dumps({"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [7]}),
        "",
        json.dumps({"timestamp": 1, "input_length": 513, "output_length": 0, "hash_ids": [1, 2]}),
        json.dumps({"timestamp": 5, "input_length": 1, "output_length": 1, "hash_ids": [3]}),
    ]
    reqs = parse_trace_lines(lines)
    assert [r.index for r in reqs] == [1, 0, 2]  # by time, file order on ties
    assert parse_trace_lines(lines, limit=2)[0].index == 1
    with pytest.raises(TraceError, match="expected 1 blocks"):
        parse_trace_lines([json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]})])
    with pytest.raises(TraceError, match=":1:"):
        parse_trace_lines(["{not json"])


def test_synthesis_is_deterministic_shared_by_id_and_truncated():
    a, b = TokenSynthesizer(seed=0, cache_size=1), TokenSynthesizer(seed=0)
    r1 = TraceRequest(0, 0, 1000, 1, (5, 6))
    r2 = TraceRequest(1, 0, 700, 1, (5, 9))
    p1, p2 = a.prompt(r1), b.prompt(r2)
    assert len(p1) == 1000 and len(p2) == 700
    assert p1[:512] == p2[:512] == b.block_tokens(5)
    assert p1[512:] == a.block_tokens(6)[:488] and p2[512:] == b.block_tokens(9)[:188]
    assert p1[512:700] != p2[512:700]
    assert all(0 <= t < 2**31 for t in p1)
    assert TokenSynthesizer(seed=1).block_tokens(5) != p1[:512]
    assert a.prompt(r1) == p1  # after the LRU evicted it


@pytest.mark.parametrize("block_size", [1, 16, 512])
def test_engine_hashes_see_exactly_the_trace_sharing(block_size):
    """Chained block hashes of two prompts agree exactly on the blocks inside their shared hash ids."""
    synth = TokenSynthesizer()
    hash_fn = get_hash_fn("xxhash")

    def hashes(tokens):
        out, parent = [], None
        for i in range(len(tokens) // block_size):
            parent = hash_block_tokens(hash_fn, parent, tokens[i * block_size : (i + 1) * block_size])
            out.append(parent)
        return out

    h1 = hashes(synth.prompt(TraceRequest(0, 0, 1536, 1, (1, 2, 3))))
    h2 = hashes(synth.prompt(TraceRequest(1, 0, 1536, 1, (1, 2, 4))))
    shared = 1024 // block_size
    assert h1[:shared] == h2[:shared]
    assert all(a != b for a, b in zip(h1[shared:], h2[shared:], strict=True))
