"""kvengine simulate: the infinite-cache ceiling counted two ways (directly, and by a replay that never
evicts), replay invariants under small caches (every request finishes, the pool ends empty), the sweep
and the simulated clock."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launch.simulate.ceiling import count_prefix_hits
from launch.simulate.executor import CostModel
from launch.simulate.replay import Replay
from launch.simulate.sweep import log_spaced, monotonic_violations, sweep
from launch.simulate.trace import TRACE_BLOCK_TOKENS, parse_trace_lines
from protocol.config import engine_config
from tests.launch.simulate_support import HAND_HITS, HAND_PROMPT_TOKENS, HAND_TRACE, fast_config, hand_trace

# ---- the ceiling ------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_direct_count_on_hand_trace(block_size):
    assert count_prefix_hits(hand_trace(), block_size) == HAND_HITS[block_size]


@pytest.mark.parametrize("block_size", [16, 64, 512])
@pytest.mark.parametrize("budget, max_seqs", [(8192, 256), (256, 2), (100, 1)])
def test_infinite_replay_equals_direct_count_on_hand_trace(block_size, budget, max_seqs):
    config = fast_config(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    result = Replay(hand_trace(), *config).run(keep_per_request=True)
    assert result.per_request_cached_tokens == HAND_HITS[block_size]
    assert result.num_cached_tokens == result.ceiling_cached_tokens == sum(HAND_HITS[block_size])
    assert result.hit_rate == pytest.approx(sum(HAND_HITS[block_size]) / HAND_PROMPT_TOKENS)
    assert result.num_preemptions == 0
    assert result.num_finished == 7 and result.checks() == []
    assert result.num_output_tokens == sum(r["output_length"] for r in HAND_TRACE)


def test_all_at_once_hand_trace_still_matches():
    """Every request at t=0: admitted together in one step, each still hits the earlier ones' blocks."""
    config = fast_config(as_fast_as_possible=True, max_num_batched_tokens=10**5)
    result = Replay(hand_trace(), *config).run(keep_per_request=True)
    assert result.per_request_cached_tokens == HAND_HITS[16]


def test_prefix_caching_off_hits_nothing():
    result = Replay(hand_trace(), *fast_config(enable_prefix_caching=False)).run()
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


@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(
    trace=random_traces(),
    block_size=st.sampled_from([16, 64, 512]),
    budget=st.sampled_from([64, 700, 4096, 100_000]),
    max_seqs=st.integers(1, 4),
)
def test_infinite_replay_equals_direct_count_random(trace, block_size, budget, max_seqs):
    config = fast_config(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs)
    result = Replay(trace, *config).run(keep_per_request=True)
    assert result.per_request_cached_tokens == count_prefix_hits(trace, block_size)
    assert result.checks() == []
    assert result.num_preemptions == 0


# ---- finite caches -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1600, 3000, 8000])
def test_small_cache_finishes_everything_and_frees_the_pool(tokens):
    config = fast_config(kv_cache_tokens=tokens, max_num_batched_tokens=512, check_executor=True)
    result = Replay(hand_trace(), *config).run()
    assert result.checks() == []
    assert result.free_blocks_at_end == result.num_blocks - 1
    assert result.num_finished + result.num_rejected == 7
    assert result.num_cached_tokens <= result.ceiling_cached_tokens
    assert 0 < result.peak_kv_usage <= 1 and 0 <= result.mean_kv_usage <= result.peak_kv_usage


def test_too_small_cache_rejects_long_prompts_but_finishes():
    result = Replay(hand_trace(), *fast_config(kv_cache_tokens=640)).run()
    assert result.max_model_len == 640
    assert result.num_rejected == 5  # all prompts but the 600- and 100-token ones
    assert result.checks() == []


def test_preemption_under_pressure_recovers():
    lines = [json.dumps({"timestamp": 0, "input_length": 500, "output_length": 300, "hash_ids": [i]}) for i in range(6)]
    result = Replay(parse_trace_lines(lines), *fast_config(kv_cache_tokens=1600, check_executor=True)).run()
    assert result.num_preemptions > 0
    assert result.checks() == []
    assert result.num_output_tokens >= 6 * 300


def test_sweep_is_monotonic_on_hand_trace():
    results = sweep(hand_trace(), *fast_config(max_num_batched_tokens=512), [800, 1600, 3200, 6400, 100_000])
    assert [r.kv_cache_tokens for r in results] == [800, 1600, 3200, 6400, 100_000]
    assert monotonic_violations(results) == []
    assert results[-1].num_cached_tokens == sum(HAND_HITS[16])
    for r in results:
        assert r.checks() == []


def test_cost_model_and_clock():
    record = {"timestamp": 1000, "input_length": 100, "output_length": 3, "hash_ids": [1]}
    trace = parse_trace_lines([json.dumps(record)])
    cost = CostModel(prefill_cost_per_token=0.001, decode_cost_per_step=0.01, cost_per_decode_token=0.1)
    result = Replay(trace, *fast_config(cost_model=cost)).run()
    # step 1: 100 prefill tokens -> 0.11 s, first token; steps 2-3: one decode token each -> 0.11 s
    assert result.ttft_p50_s == pytest.approx(0.11)
    assert result.sim_time_s == pytest.approx(1.0 + 0.33)
    assert result.num_prefill_tokens_computed == 100 and result.num_decode_tokens_computed == 2
    scaled = Replay(trace, *fast_config(cost_model=cost, time_scale=0.5)).run()
    assert scaled.sim_time_s == pytest.approx(0.5 + 0.33)


def test_helpers():
    assert log_spaced(1e4, 1e8, 5) == [10**4, 10**5, 10**6, 10**7, 10**8]
    with pytest.raises(ValueError, match="divide"):
        Replay(hand_trace(), engine_config(block_size=48))
    with pytest.raises(ValueError, match="divide"):
        count_prefix_hits(hand_trace(), 48)
