"""The data-parallel replay: N real engine cores behind the real router on one simulated clock."""

import json

import pytest

from launch.cli import main
from launch.simulate.ceiling import count_prefix_hits
from launch.simulate.dp_replay import DPReplay
from launch.simulate.replay import Replay
from launch.simulate.trace import parse_trace_lines
from tests.launch.simulate_support import fast_config, hand_trace, write_trace


def conversations(n: int):
    """n conversations of four turns; each turn repeats the conversation so far and adds a block. A turn's
    requests arrive together, 5 s after the last turn's, which has finished and announced its blocks by then."""
    return parse_trace_lines(json.dumps(
        {"timestamp": 5000 * turn, "input_length": 512 * (turn + 1) + 100, "output_length": 4,
         "hash_ids": [1000 * c + k for k in range(turn + 2)]}) for turn in range(4) for c in range(n))


def test_one_engine_replays_exactly_like_the_single_engine_replay():
    """DP 1 is the single-engine replay: same hits, steps and simulated TTFTs, on a pool that evicts."""
    config, sim = fast_config(kv_cache_tokens=2048, max_num_seqs=4)
    single = Replay(hand_trace(), config, sim).run()
    dp = DPReplay(hand_trace(), config, sim, 1, "prefix").run()
    assert dp.checks() == [] and single.checks() == []
    assert dp.num_cached_tokens == single.num_cached_tokens
    assert dp.engines[0].num_steps == single.num_steps
    assert (dp.ttft_p50_s, dp.ttft_p99_s, dp.sim_time_s) == (single.ttft_p50_s, single.ttft_p99_s, single.sim_time_s)


def test_prefix_routing_reaches_the_ceiling_on_disjoint_conversations_and_round_robin_does_not():
    """Every later turn goes to the engine holding its conversation: with caches that never evict, that is the
    infinite-cache hit count. Round-robin scatters the turns (3 conversations over 2 engines in turn: each turn
    lands where the last one did not)."""
    config, sim = fast_config()
    requests = conversations(3)
    ceiling = sum(count_prefix_hits(requests, config.cache.block_size))
    prefix = DPReplay(requests, config, sim, 2, "prefix").run()
    robin = DPReplay(requests, config, sim, 2, "round-robin").run()
    assert prefix.checks() == [] and robin.checks() == []
    assert prefix.num_cached_tokens == ceiling > 0
    assert robin.num_cached_tokens < ceiling
    assert [e.num_requests for e in prefix.engines] == [8, 4]  # conversations 0, 2 and 1 (load breaks the tie)
    assert all(e.hit_rate > 0 for e in prefix.engines)


def test_the_total_kv_capacity_is_split_evenly():
    config, sim = fast_config(kv_cache_tokens=16384)
    result = DPReplay(conversations(4), config, sim, 4, "least-load").run()
    assert result.checks() == []
    assert (result.kv_cache_tokens_per_engine, result.kv_cache_tokens) == (4096, 16384)
    assert [e.num_requests for e in result.engines] == [4, 4, 4, 4]


def test_requests_longer_than_an_engine_are_rejected_and_counted():
    config, sim = fast_config(kv_cache_tokens=2 * 1024)  # 1024 tokens per engine: r1, r4 and r5 do not fit
    result = DPReplay(hand_trace(), config, sim, 2, "prefix").run()
    assert result.checks() == []
    assert (result.num_rejected, result.num_too_long) == (3, 3)


def test_cli_replays_data_parallel(tmp_path, capsys):
    trace = write_trace(tmp_path)
    assert main(["simulate", "--trace", trace, "--json", "--no-progress", "-dp", "2", "--router-policy",
                 "round-robin"]) == 0
    out = json.loads(capsys.readouterr().out)
    result = out["result"]
    assert out["problems"] == []
    assert (result["num_engines"], result["router_policy"]) == (2, "round-robin")
    assert [e["num_requests"] for e in result["engines"]] == [4, 3]
    assert main(["simulate", "--trace", trace, "--no-progress", "-dp", "2"]) == 0
    table = capsys.readouterr().out
    assert "2 behind the router, policy prefix" in table
    engine_rows = table.split("steps\n", 1)[1].splitlines()
    assert [row.split()[0] for row in engine_rows] == ["0", "1"]
    assert sum(int(row.split()[1]) for row in engine_rows) == 7


@pytest.mark.parametrize("flags, message", [
    (["-dp", "2", "--sweep"], "drop --data-parallel-size"),
    (["-dp", "2", "--check-ceiling"], "drop --data-parallel-size"),
    (["-tp", "2"], "--tensor-parallel-size has no effect"),
])
def test_cli_refuses_what_a_dp_replay_cannot_do(tmp_path, capsys, flags, message):
    assert main(["simulate", "--trace", write_trace(tmp_path), "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err
