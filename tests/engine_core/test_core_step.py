"""EngineCore: start-up sizing, the step loop, empty steps, what reaches the executor, wire validity."""

import pytest

from engine_core.core import EngineCore
from engine_core.kv_cache.planning import KVCacheSizingError
from protocol import FullAttentionSpec, SlidingWindowSpec
from protocol.codec import engine_to_worker_codec, outputs_codec
from protocol.config import engine_config
from tests.engine_core.scheduler_support import (
    SPEC,
    RecordingExecutor,
    assert_pool_empty,
    expected_tokens,
    make_core,
    make_request,
    prompt_of,
    run,
)

# ---- start-up -------------------------------------------------------------------------------


def test_start_up_takes_the_minimum_block_count_across_ranks():
    page = SPEC.page_size_bytes
    ex = RecordingExecutor(available_kv_bytes=[300 * page + 7, 120 * page, 500 * page], kv_cache_specs={"l": SPEC})
    core = EngineCore(engine_config(max_model_len=512), ex)
    assert core.kv_cache_config.num_blocks == 120
    assert ex.kv_cache_config == core.kv_cache_config  # the executor got the final config
    assert core.scheduler.kv_cache_manager.get_num_free_blocks() == 119


def test_start_up_resolves_and_checks_max_model_len():
    ex = RecordingExecutor(kv_cache_specs={"l": SPEC}, max_position_embeddings=2048)
    assert EngineCore(engine_config(), ex).max_model_len == 2048
    with pytest.raises(KVCacheSizingError, match="max_position_embeddings"):
        EngineCore(engine_config(max_model_len=4096), RecordingExecutor(max_position_embeddings=2048))
    with pytest.raises(KVCacheSizingError, match="estimated maximum model length is 160"):
        EngineCore(engine_config(max_model_len=1024, num_gpu_blocks_override=11), RecordingExecutor())


# ---- empty steps ----------------------------------------------------------------------------


def test_step_with_nothing_to_do_is_valid_and_skips_the_executor():
    core, ex = make_core()
    assert not core.has_work()
    for _ in range(3):
        out = core.step()
        assert out.outputs == []
    assert ex.outputs == []
    # rejections alone: outputs, but still nothing for the executor
    core.add_request(make_request("bad", [], max_tokens=1))
    assert core.has_work()
    out = core.step()
    assert [(o.request_id, o.finish_reason) for o in out.outputs] == [("bad", "error")]
    assert ex.outputs == [] and not core.has_work()
    assert core.step().outputs == []


# ---- what reaches the executor --------------------------------------------------------------


def test_finished_ids_reach_the_executor_in_the_next_step():
    core, ex = make_core()
    core.add_request(make_request("short", prompt_of(1, 20), max_tokens=2))
    core.add_request(make_request("long", prompt_of(2, 20), max_tokens=6))
    core.step()
    core.step()
    assert core.results.finish == {"short": "length"}
    assert "short" in ex.token_ids  # the worker has not heard yet
    core.step()
    assert ex.outputs[-1].finished_req_ids == ["short"]
    assert "short" not in ex.token_ids and "short" not in ex.block_tables
    assert set(ex.block_tables) == {"long"}
    assert all("short" not in so.finished_req_ids for so in ex.outputs[:-1])


def test_no_request_state_lingers_in_the_executor_after_a_workload():
    """When the engine runs out of work, every finished id has reached the executor.

    Otherwise the workers keep the rows and token histories of the last requests while idle, and
    their block tables differ from the ledger (which holds nothing) until some later request arrives.
    """
    core, ex = make_core(num_blocks=24, max_model_len=256, budget=128)
    for i in range(5):
        core.add_request(make_request(f"r{i}", prompt_of(i, 30 + 10 * i), max_tokens=5 + i))
    core.step()
    core.abort_requests(["r4"])
    run(core, ex)
    assert not core.has_work()
    assert ex.token_ids == {} and ex.block_tables == {} and ex.num_computed_tokens == {}
    told = [rid for so in ex.outputs for rid in so.finished_req_ids]
    assert sorted(told) == [f"r{i}" for i in range(5)]  # each id exactly once
    assert_pool_empty(core)


def test_aborted_ids_reach_the_executor():
    core, ex = make_core()
    core.add_request(make_request("a", prompt_of(1, 20), max_tokens=50))
    core.add_request(make_request("b", prompt_of(2, 20), max_tokens=50))
    core.step()
    core.abort_requests(["a"])
    core.step()
    so = ex.outputs[-1]
    assert so.finished_req_ids == ["a"] and set(so.num_scheduled_tokens) == {"b"}
    assert set(ex.block_tables) == {"b"}
    assert [o.finish_reason for o in core.step().outputs] == [None]


def test_every_scheduler_output_and_client_output_survives_the_wire():
    """SchedulerOutputs and EngineCoreOutputs of a preempting workload round-trip through their codecs."""
    core, ex = make_core(num_blocks=20, max_model_len=128, budget=64)
    w2e, out_codec = engine_to_worker_codec(), outputs_codec()
    decoded = []
    ex.on_execute = lambda so: decoded.append(w2e.decode(w2e.encode(so)))
    for i in range(8):
        core.add_request(make_request(f"r{i}", prompt_of(i, 20 + 7 * i), max_tokens=30))
    while core.has_work():
        out = core.step()
        assert out_codec.decode(out_codec.encode(out)) == out
    assert decoded == ex.outputs
    assert core.get_stats().num_preemptions > 0
    assert_pool_empty(core)


def test_stats_round_trip_and_count_tokens():
    core, ex = make_core()
    prompt = prompt_of(3, 33)
    core.add_request(make_request("s", prompt, max_tokens=4))
    results = run(core, ex)
    stats = core.get_stats()
    assert results.tokens["s"] == expected_tokens(prompt, 4)
    assert stats.num_prompt_tokens == 33 and stats.num_generation_tokens == 4
    assert stats.prefix_cache_queries == 33 and stats.prefix_cache_hits == 0
    assert stats.num_free_blocks == core.kv_cache_config.num_blocks - 1
    assert stats.num_cached_free_blocks == 2  # two full prompt blocks stay cached after the finish


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_sliding_window_block_tables_match_the_ledger(prefix_caching):
    """Hybrid full + sliding-window cache under preemption: the executor nulls blocks that left the
    window exactly as the ledger does, so the digest check passes at every step."""
    specs = {
        "full.0": FullAttentionSpec(16, 1, 8, 2),
        "swa.0": SlidingWindowSpec(16, 1, 8, 2, 32),
    }
    core, ex = make_core(
        num_blocks=40, max_model_len=256, budget=64, kv_cache_specs=specs, prefix_caching=prefix_caching
    )
    assert len(core.kv_cache_config.kv_cache_groups) == 2
    manager = core.scheduler.kv_cache_manager
    nulls = []

    def check(so):
        nulls.extend(manager.get_block_ids(r.request_id)[1].count(0)  # also the running requests not scheduled
                     for r in core.scheduler.running if r.request_id in ex.block_tables)

    ex.on_execute = check
    shared = prompt_of(77, 64)
    prompts = {f"s{i}": (shared if i % 2 else []) + prompt_of(i, 40 + 13 * i) for i in range(6)}
    for rid, prompt in prompts.items():
        core.add_request(make_request(rid, prompt, max_tokens=60))
    results = run(core, ex)  # the executor raises on any digest mismatch
    for rid, prompt in prompts.items():
        assert results.tokens[rid] == expected_tokens(prompt, 60)
    assert max(nulls) > 0  # blocks really left the window
    assert core.get_stats().num_preemptions > 0
    assert ex.block_tables == {}
    assert_pool_empty(core)


def test_the_engine_core_never_imports_torch():
    import subprocess
    import sys
    from pathlib import Path

    code = ("import sys, engine_core.core, engine_core.scheduler, engine_core.executor.reference_executor; "
            "sys.exit('torch' in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


@pytest.mark.parametrize("hybrid", [False, True])
def test_block_stats_equal_a_walk_of_the_ledger_after_every_step(hybrid):
    """make_stats derives held blocks, cached-free blocks and stored tokens without walking the pool."""
    specs = {"full.0": FullAttentionSpec(16, 1, 8, 2)}
    if hybrid:
        specs["swa.0"] = SlidingWindowSpec(16, 1, 8, 2, 32)
    core, _ex = make_core(num_blocks=40, max_model_len=256, budget=64, kv_cache_specs=specs)
    manager, pool = core.scheduler.kv_cache_manager, core.scheduler.kv_cache_manager.block_pool
    shared = prompt_of(5, 48)
    for i in range(8):
        core.add_request(make_request(f"r{i}", (shared if i % 2 else []) + prompt_of(i, 20 + 9 * i), max_tokens=50))
    checked = 0
    while core.has_work():
        core.step()
        fill = {}
        for r in core.scheduler.running:
            for group in manager.get_blocks(r.request_id).blocks:
                for i, b in enumerate(group):
                    if not b.is_null:
                        fill[b] = max(fill.get(b, 0), min(16, r.num_computed_tokens - i * 16))
        stats = core.get_stats()
        assert stats.num_blocks_held == len(fill)
        assert stats.num_tokens_stored == sum(fill.values())
        free = pool.free_block_queue.get_all_free_blocks()
        assert stats.num_cached_free_blocks == sum(b.block_hash is not None for b in free)
        checked += bool(fill)
    assert checked > 10 and core.get_stats().num_preemptions > 0
