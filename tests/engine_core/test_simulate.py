"""kvengine simulate: trace parsing, token synthesis, the infinite-cache ceiling counted two ways,
replay invariants (every request finishes, the pool ends empty) and the CLI."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core.kv_cache.hashing import get_hash_fn, hash_block_tokens
from engine_core.simulate import (
    TRACE_BLOCK_TOKENS,
    CostModel,
    SimConfig,
    TokenSynthesizer,
    TraceError,
    TraceRequest,
    count_prefix_hits,
    log_spaced,
    monotonic_violations,
    parse_trace_lines,
    percentile,
    replay,
    sweep,
)

# A hand-written trace. Blocks are 512 tokens; the last block of a prompt may be partial.
#   r0  [1,2]     1024 tokens: nothing seen before                                     -> 0
#   r1  [1,2,3]   1500 tokens: [1,2] seen whole                                        -> 1024
#   r2  [1,4]      600 tokens: [1] seen; [1,4] new (block 4 holds 88 tokens here)      -> 512
#   r3  [1,2]     1024 tokens: the whole prompt seen, but the last token is computed:
#                 min(1024, 1023) rounded down to the block size -> 1008 (bs 16), 512 (bs 512)
#   r4  [1,2,3]   1300 tokens: r1 had 476 tokens of block 3, r4 has 276: 1024 + 276 = 1300,
#                 capped at 1299 -> 1296 (bs 16), 1024 (bs 512)
#   r5  [1,4,8]   1100 tokens: block 4 is full here but r2 had only its first 88 tokens:
#                 512 + 88 = 600 -> 592 (bs 16), 512 (bs 512); block 8 is never reached
#   r6  [9]        100 tokens: new                                                     -> 0
HAND_TRACE = [
    {"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},
    {"timestamp": 10, "input_length": 1500, "output_length": 4, "hash_ids": [1, 2, 3]},
    {"timestamp": 20, "input_length": 600, "output_length": 2, "hash_ids": [1, 4]},
    {"timestamp": 30, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 40, "input_length": 1300, "output_length": 5, "hash_ids": [1, 2, 3]},
    {"timestamp": 50, "input_length": 1100, "output_length": 3, "hash_ids": [1, 4, 8]},
    {"timestamp": 60, "input_length": 100, "output_length": 2, "hash_ids": [9]},
]
HAND_PROMPT_TOKENS = 1024 + 1500 + 600 + 1024 + 1300 + 1100 + 100  # 6648
HAND_HITS = {
    16: [0, 1024, 512, 1008, 1296, 592, 0],  # 4432
    64: [0, 1024, 512, 960, 1280, 576, 0],  # 1023 -> 960, 1299 -> 1280, 600 -> 576
    512: [0, 1024, 512, 512, 1024, 512, 0],  # 3584
}


def hand_trace() -> list[TraceRequest]:
    return parse_trace_lines(json.dumps(r) for r in HAND_TRACE)


def fast_config(**kw) -> SimConfig:
    kw.setdefault("prefix_caching_hash_algo", "xxhash")
    return SimConfig(**kw)


# ---- trace and tokens ------------------------------------------------------------------------------


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
    assert all(a != b for a, b in zip(h1[shared:], h2[shared:]))


# ---- the ceiling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_direct_count_on_hand_trace(block_size):
    assert count_prefix_hits(hand_trace(), block_size) == HAND_HITS[block_size]


@pytest.mark.parametrize("block_size", [16, 64, 512])
@pytest.mark.parametrize("budget, max_seqs", [(8192, 256), (256, 2), (100, 1)])
def test_infinite_replay_equals_direct_count_on_hand_trace(block_size, budget, max_seqs):
    result = replay(
        hand_trace(),
        fast_config(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs),
        keep_per_request=True,
    )
    assert result.per_request_cached_tokens == HAND_HITS[block_size]
    assert result.num_cached_tokens == result.ceiling_cached_tokens == sum(HAND_HITS[block_size])
    assert result.hit_rate == pytest.approx(sum(HAND_HITS[block_size]) / HAND_PROMPT_TOKENS)
    assert result.num_preemptions == 0
    assert result.num_finished == 7 and result.checks() == []
    assert result.num_output_tokens == sum(r["output_length"] for r in HAND_TRACE)


def test_all_at_once_hand_trace_still_matches():
    """Every request at t=0: admitted together in one step, each still hits the earlier ones' blocks."""
    result = replay(hand_trace(), fast_config(as_fast_as_possible=True, max_num_batched_tokens=10**5),
                    keep_per_request=True)
    assert result.per_request_cached_tokens == HAND_HITS[16]


def test_prefix_caching_off_hits_nothing():
    result = replay(hand_trace(), fast_config(enable_prefix_caching=False))
    assert result.num_cached_tokens == 0 and result.checks() == []
    assert result.ceiling_cached_tokens == sum(HAND_HITS[16])


@st.composite
def random_traces(draw):
    """Prefix trees of hash ids: each request continues a random earlier chain, then new blocks."""
    chains: list[list[int]] = []
    next_id = 0
    lines = []
    t = 0
    for _ in range(draw(st.integers(1, 8))):
        base: list[int] = []
        if chains and draw(st.booleans()):
            parent = draw(st.sampled_from(chains))
            base = parent[: draw(st.integers(0, len(parent)))]
        extra = draw(st.integers(0 if base else 1, 3))
        ids = base + list(range(next_id, next_id + extra))
        next_id += extra
        chains.append(ids)
        last = draw(st.integers(1, TRACE_BLOCK_TOKENS))
        t += draw(st.sampled_from([0, 0, 1, 50, 5000]))
        lines.append(json.dumps({
            "timestamp": t,
            "input_length": (len(ids) - 1) * TRACE_BLOCK_TOKENS + last,
            "output_length": draw(st.integers(0, 4)),
            "hash_ids": ids,
        }))
    return parse_trace_lines(lines)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    trace=random_traces(),
    block_size=st.sampled_from([16, 64, 512]),
    budget=st.sampled_from([64, 700, 4096, 100_000]),
    max_seqs=st.integers(1, 4),
)
def test_infinite_replay_equals_direct_count_random(trace, block_size, budget, max_seqs):
    cfg = fast_config(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    result = replay(trace, cfg, keep_per_request=True)
    assert result.per_request_cached_tokens == count_prefix_hits(trace, block_size)
    assert result.checks() == []
    assert result.num_preemptions == 0


# ---- finite caches -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1600, 3000, 8000])
def test_small_cache_finishes_everything_and_frees_the_pool(tokens):
    result = replay(hand_trace(), fast_config(kv_cache_tokens=tokens, max_num_batched_tokens=512, check_executor=True))
    assert result.checks() == []
    assert result.free_blocks_at_end == result.num_blocks - 1
    assert result.num_finished + result.num_rejected == 7
    assert result.num_cached_tokens <= result.ceiling_cached_tokens
    assert 0 < result.peak_kv_usage <= 1 and 0 <= result.mean_kv_usage <= result.peak_kv_usage


def test_too_small_cache_rejects_long_prompts_but_finishes():
    result = replay(hand_trace(), fast_config(kv_cache_tokens=640))
    assert result.max_model_len == 640
    assert result.num_rejected == 5  # all prompts but the 600- and 100-token ones
    assert result.checks() == []


def test_preemption_under_pressure_recovers():
    lines = [json.dumps({"timestamp": 0, "input_length": 500, "output_length": 300, "hash_ids": [i]}) for i in range(6)]
    result = replay(parse_trace_lines(lines), fast_config(kv_cache_tokens=1600, check_executor=True))
    assert result.num_preemptions > 0
    assert result.checks() == []
    assert result.num_output_tokens >= 6 * 300


def test_sweep_is_monotonic_on_hand_trace():
    trace = hand_trace() * 1  # same objects; the sweep replays them per size
    results = sweep(trace, fast_config(max_num_batched_tokens=512), [800, 1600, 3200, 6400, 100_000])
    assert [r.kv_cache_tokens for r in results] == [800, 1600, 3200, 6400, 100_000]
    assert monotonic_violations(results) == []
    assert results[-1].num_cached_tokens == sum(HAND_HITS[16])
    for r in results:
        assert r.checks() == []


def test_cost_model_and_clock():
    trace = parse_trace_lines([json.dumps({"timestamp": 1000, "input_length": 100, "output_length": 3, "hash_ids": [1]})])
    cost = CostModel(prefill_cost_per_token=0.001, decode_cost_per_step=0.01, cost_per_decode_token=0.1)
    result = replay(trace, fast_config(cost_model=cost))
    # step 1: 100 prefill tokens -> 0.11 s, first token; steps 2-3: one decode token each -> 0.11 s
    assert result.ttft_p50_s == pytest.approx(0.11)
    assert result.sim_time_s == pytest.approx(1.0 + 0.33)
    assert result.num_prefill_tokens_computed == 100 and result.num_decode_tokens_computed == 2
    scaled = replay(trace, fast_config(cost_model=cost, time_scale=0.5))
    assert scaled.sim_time_s == pytest.approx(0.5 + 0.33)


def test_helpers():
    assert log_spaced(1e4, 1e8, 5) == [10**4, 10**5, 10**6, 10**7, 10**8]
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4 and percentile([], 50) is None
    with pytest.raises(ValueError, match="divide"):
        SimConfig(block_size=48)


# ---- CLI -----------------------------------------------------------------------------------------


def write_trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in HAND_TRACE) + "\n")
    return str(path)


def test_cli_table_and_ceiling_check(tmp_path, capsys):
    from launch.cli import main

    rc = main(["simulate", "--trace", write_trace(tmp_path), "--check-ceiling", "--no-progress",
               "--prefix-caching-hash-algo", "xxhash"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "4,432" in out and "66.67%" in out and "per request equal: True" in out


def test_cli_json_and_sweep(tmp_path, capsys):
    from launch.cli import main

    trace = write_trace(tmp_path)
    assert main(["simulate", "--trace", trace, "--json", "--no-progress", "--kv-cache-tokens", "3k"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["result"]["kv_cache_tokens"] == 2992 and data["problems"] == []
    assert main(["simulate", "--trace", trace, "--json", "--no-progress", "--sweep", "--sweep-min", "1000",
                 "--sweep-max", "1e5", "--sweep-points", "3", "--max-num-batched-tokens", "512"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [r["kv_cache_tokens"] for r in data["sweep"]] == [992, 10000, 100000]
    assert data["problems"] == []


def test_cli_bad_input(tmp_path, capsys):
    from launch.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["simulate", "--trace", str(bad), "--no-progress"]) == 2
    assert "not a Mooncake trace record" in capsys.readouterr().err
    assert main(["simulate", "--trace", write_trace(tmp_path), "--block-size", "48", "--no-progress"]) == 2


def test_cli_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from launch.cli import main

    png = tmp_path / "sweep.png"
    assert main(["simulate", "--trace", write_trace(tmp_path), "--no-progress", "--sweep", "--sweep-min", "1000",
                 "--sweep-max", "1e4", "--sweep-points", "2", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
    assert "plot written" in capsys.readouterr().out
