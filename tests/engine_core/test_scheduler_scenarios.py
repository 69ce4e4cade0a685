"""Scheduler scenarios, driven through EngineCore + ReferenceExecutor (block-table digests on)."""

import random

import pytest

from engine_core.scheduler import Scheduler
from protocol import KVCacheConfig, KVCacheGroupSpec, ModelRunnerOutput
from protocol.config import engine_config
from tests.engine_core.scheduler_support import (
    BLOCK_SIZE,
    SPEC,
    VOCAB,
    assert_pool_empty,
    cdiv,
    expected_tokens,
    make_core,
    make_request,
    prompt_of,
    run,
)

# ---- budget, max_num_seqs, order ------------------------------------------------------------


@pytest.mark.parametrize("budget,max_num_seqs", [(128, 8), (37, 3), (2048, 256)])
def test_budget_and_max_num_seqs_hold_every_step(budget, max_num_seqs):
    core, ex = make_core(num_blocks=200, max_model_len=512, budget=budget, max_num_seqs=max_num_seqs)
    rng = random.Random(budget)
    lengths = {}
    for i in range(30):
        prompt = prompt_of(i, rng.randint(1, 300))
        lengths[f"r{i}"] = (prompt, rng.randint(1, 20))
        core.add_request(make_request(f"r{i}", prompt, max_tokens=lengths[f"r{i}"][1]))
    results = run(core, ex)  # checks budget / max_num_seqs / bookkeeping of every SchedulerOutput
    assert any(so.total_num_scheduled_tokens == budget for so in ex.outputs) or budget == 2048
    assert max(len(so.num_scheduled_tokens) for so in ex.outputs) <= max_num_seqs
    for rid, (prompt, n) in lengths.items():
        assert results.tokens[rid] == expected_tokens(prompt, n)
        assert results.finish[rid] == "length"
    assert_pool_empty(core)


def test_running_requests_are_scheduled_before_waiting_ones():
    core, ex = make_core(budget=64)
    core.add_request(make_request("long", prompt_of(1, 200), max_tokens=3))
    core.step()  # first chunk of 64
    core.add_request(make_request("late", prompt_of(2, 50), max_tokens=3, arrival_time=-1.0))
    for _ in range(2):  # the running prefill takes the whole budget; the waiting one gets nothing
        core.step()
        so = ex.outputs[-1]
        assert so.num_scheduled_tokens == {"long": 64}
        assert so.scheduled_cached_reqs.req_ids == ["long"] and not so.scheduled_new_reqs
    core.step()  # 8 prompt tokens left for "long"; the rest of the budget admits "late"
    so = ex.outputs[-1]
    assert so.num_scheduled_tokens == {"long": 8, "late": 50}
    assert list(so.num_scheduled_tokens) == ["long", "late"]
    core.step()  # decode of "long" first, then the rest of "late"
    so = ex.outputs[-1]
    assert so.num_scheduled_tokens == {"long": 1, "late": 1}
    results = run(core, ex)
    assert results.finish == {"long": "length", "late": "length"}
    assert_pool_empty(core)


def test_5000_token_prompt_is_prefilled_in_chunks_then_decodes():
    budget, n_prompt, max_tokens = 512, 5000, 6
    core, ex = make_core(num_blocks=400, max_model_len=6000, budget=budget)
    prompt = prompt_of(5, n_prompt)
    core.add_request(make_request("big", prompt, max_tokens=max_tokens))
    results = run(core, ex)
    *steps, last = ex.outputs
    assert last.total_num_scheduled_tokens == 0 and last.finished_req_ids == ["big"]  # the workers hear of the finish
    chunks = [so.num_scheduled_tokens["big"] for so in steps]
    assert chunks == [budget] * (n_prompt // budget) + [n_prompt % budget] + [1] * (max_tokens - 1)
    # Only the first chunk is a new request; every later one appends blocks to its table.
    assert [len(so.scheduled_new_reqs) for so in steps] == [1] + [0] * (len(chunks) - 1)
    computed = [so.scheduled_cached_reqs.num_computed_tokens[0] for so in steps[1:]]
    assert computed == [budget * k for k in range(1, n_prompt // budget + 1)] + list(range(n_prompt, n_prompt + 5))
    assert results.tokens["big"] == expected_tokens(prompt, max_tokens)
    assert ex.outputs[0].scheduled_new_reqs[0].block_ids == [list(range(1, budget // BLOCK_SIZE + 1))]
    assert_pool_empty(core)


# ---- prefix cache ---------------------------------------------------------------------------


def test_shared_prefix_is_computed_once():
    core, ex = make_core(budget=4096)
    prefix = prompt_of(9, 64)  # four full blocks
    a, b = prefix + prompt_of(10, 10), prefix + prompt_of(11, 20)
    core.add_request(make_request("a", a, max_tokens=4))
    core.step()
    a_blocks = ex.outputs[-1].scheduled_new_reqs[0].block_ids[0]
    core.add_request(make_request("b", b, max_tokens=4))
    core.step()
    so = ex.outputs[-1]
    new_b = so.scheduled_new_reqs[0]
    assert new_b.req_id == "b" and new_b.num_computed_tokens == 64
    assert so.num_scheduled_tokens["b"] == 20
    assert new_b.block_ids[0][:4] == a_blocks[:4] and new_b.block_ids[0][4] != a_blocks[4]
    stats = core.get_stats()
    assert stats.prefix_cache_queries == len(a) + len(b) and stats.prefix_cache_hits == 64
    results = run(core, ex)
    assert results.num_cached == {"a": 0, "b": 64}
    assert results.tokens == {"a": expected_tokens(a, 4), "b": expected_tokens(b, 4)}
    # After both finished the prefix is still cached: a third request hits it from the free queue.
    core.add_request(make_request("c", prefix + [5], max_tokens=1))
    results = run(core, ex)
    assert results.num_cached["c"] == 64 and core.get_stats().prefix_cache_hits == 128
    assert_pool_empty(core)


def test_shared_prefix_within_one_step_and_cache_salt_isolates():
    core, ex = make_core(budget=4096)
    prefix = prompt_of(3, 48)
    core.add_request(make_request("x", prefix + [1, 2], max_tokens=2))
    core.add_request(make_request("y", prefix + [3, 4], max_tokens=2))
    core.add_request(make_request("z", prefix + [3, 4], max_tokens=2, cache_salt="tenant-2"))
    core.step()
    so = ex.outputs[-1]
    assert so.num_scheduled_tokens == {"x": 50, "y": 2, "z": 50}
    results = run(core, ex)
    assert results.num_cached == {"x": 0, "y": 48, "z": 0}
    assert results.tokens["y"] == results.tokens["z"] == expected_tokens(prefix + [3, 4], 2)
    assert_pool_empty(core)


def test_no_prefix_caching_computes_everything():
    core, ex = make_core(budget=4096, prefix_caching=False)
    prefix = prompt_of(3, 64)
    core.add_request(make_request("x", prefix + [1], max_tokens=2))
    run(core, ex)
    core.add_request(make_request("y", prefix + [1], max_tokens=2))
    results = run(core, ex)
    first_y = next(so for so in ex.outputs if so.scheduled_new_reqs and so.scheduled_new_reqs[0].req_id == "y")
    assert results.num_cached["y"] == 0 and first_y.num_scheduled_tokens == {"y": 65}
    assert_pool_empty(core)


# ---- preemption -----------------------------------------------------------------------------


def _workload(seed: int, n: int = 14):
    rng = random.Random(seed)
    shared = prompt_of(1000 + seed, 32)
    reqs = []
    for i in range(n):
        prompt = prompt_of(seed * 100 + i, rng.randint(5, 90))
        if i % 3 == 0:
            prompt = shared + prompt
        reqs.append((f"q{i}", prompt, rng.randint(10, 60)))
    return reqs


def _run_workload(reqs, num_blocks, policy="fcfs", prefix_caching=True, budget=256):
    core, ex = make_core(
        num_blocks=num_blocks, max_model_len=256, budget=budget, policy=policy, prefix_caching=prefix_caching
    )
    for i, (rid, prompt, max_tokens) in enumerate(reqs):
        core.add_request(make_request(rid, prompt, max_tokens=max_tokens, arrival_time=float(i), priority=i % 3))
    return core, ex, run(core, ex)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_small_pool_gives_the_same_tokens(policy, prefix_caching):
    reqs = _workload(seed=7)
    _, _, reference = _run_workload(reqs, num_blocks=4000, policy=policy, prefix_caching=prefix_caching)
    core, ex, results = _run_workload(reqs, num_blocks=24, policy=policy, prefix_caching=prefix_caching)
    assert core.get_stats().num_preemptions > 0
    assert any(so.preempted_req_ids for so in ex.outputs)
    assert results.tokens == reference.tokens
    assert results.finish == reference.finish == {rid: "length" for rid, _, _ in reqs}
    for rid, prompt, max_tokens in reqs:
        assert results.tokens[rid] == expected_tokens(prompt, max_tokens)
    assert_pool_empty(core)


def test_preempted_requests_come_back_as_new_with_outputs_and_full_block_ids():
    reqs = _workload(seed=3)
    core, ex = make_core(num_blocks=24, max_model_len=256, budget=256)
    manager = core.scheduler.kv_cache_manager
    ledger_views = []  # the ledger's block ids of every new request, when the executor receives it
    ex.on_execute = lambda so: ledger_views.append({r.req_id: manager.get_block_ids(r.req_id) for r in so.scheduled_new_reqs})
    prompts = {}
    for i, (rid, prompt, max_tokens) in enumerate(reqs):
        prompts[rid] = prompt
        core.add_request(make_request(rid, prompt, max_tokens=max_tokens, arrival_time=float(i)))
    results = run(core, ex)
    preempted_at = {}
    resumed = 0
    for k, so in enumerate(ex.outputs):
        for new in so.scheduled_new_reqs:
            assert new.block_ids == ledger_views[k][new.req_id]
            total = new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]
            assert len(new.block_ids[0]) == cdiv(total, BLOCK_SIZE)
            assert new.prompt_token_ids == prompts[new.req_id]
            if new.req_id in preempted_at:
                resumed += 1
                del preempted_at[new.req_id]
                # generated tokens travel with the request, so the worker can recompute them
                assert new.output_token_ids == results.tokens[new.req_id][: len(new.output_token_ids)]
            else:
                assert new.output_token_ids == []
        for rid in so.preempted_req_ids:
            preempted_at[rid] = k
            assert rid not in so.num_scheduled_tokens
        for rid in so.scheduled_cached_reqs.req_ids:
            assert rid not in preempted_at, f"{rid} scheduled as cached after its preemption"
    assert resumed > 0 and not preempted_at
    assert any(
        new.output_token_ids for so in ex.outputs for new in so.scheduled_new_reqs
    ), "no request was preempted during decode"
    assert_pool_empty(core)


def test_fcfs_preempts_the_newest_running_request():
    core, ex = make_core(num_blocks=9, max_model_len=80, budget=256)  # 8 usable blocks
    core.add_request(make_request("x", prompt_of(1, 32), max_tokens=40, arrival_time=0.0))
    core.step()
    core.add_request(make_request("b", prompt_of(2, 32), max_tokens=40, arrival_time=2.0))
    core.step()
    core.add_request(make_request("a", prompt_of(3, 32), max_tokens=40, arrival_time=1.0))
    core.step()
    assert [r.request_id for r in core.scheduler.running] == ["x", "b", "a"]
    core.step()  # "a" needs a third block and none is free: the newest running request goes
    so = ex.outputs[-1]
    assert so.preempted_req_ids == ["a"]
    assert set(so.num_scheduled_tokens) == {"x", "b"}
    results = run(core, ex)
    assert results.finish == {"x": "length", "b": "length", "a": "length"}
    assert_pool_empty(core)


def test_priority_preempts_largest_priority_value_then_latest_arrival():
    core, ex = make_core(num_blocks=9, max_model_len=80, budget=256, policy="priority")  # 8 usable blocks
    core.add_request(make_request("x", prompt_of(1, 32), max_tokens=40, arrival_time=0.0, priority=9))
    core.step()
    core.add_request(make_request("b", prompt_of(2, 32), max_tokens=40, arrival_time=2.0, priority=9))
    core.step()
    core.add_request(make_request("a", prompt_of(3, 32), max_tokens=40, arrival_time=1.0, priority=0))
    core.step()
    assert [r.request_id for r in core.scheduler.running] == ["x", "b", "a"]
    core.step()  # "a" needs a block: "b" (priority 9, later than "x") is preempted, even though already scheduled
    so = ex.outputs[-1]
    assert so.preempted_req_ids == ["b"]
    assert set(so.num_scheduled_tokens) == {"x", "a"}
    assert "b" not in so.scheduled_cached_reqs.req_ids
    assert core.scheduler.num_preemptions == 1
    results = run(core, ex)
    for rid, seed in (("x", 1), ("b", 2), ("a", 3)):
        assert results.tokens[rid] == expected_tokens(prompt_of(seed, 32), 40)
    assert_pool_empty(core)


def test_priority_a_request_that_preempts_itself_ends_the_running_pass():
    """As vLLM: when the request being scheduled is the least important and no block is free, it is preempted
    and no running request after it is scheduled in that step, though "b" would fit in its own blocks."""
    core, ex = make_core(num_blocks=4, max_model_len=48, budget=256, policy="priority")  # 3 usable blocks
    core.add_request(make_request("a", prompt_of(1, 10), max_tokens=20, arrival_time=0.0, priority=3))
    core.step()
    core.add_request(make_request("b", prompt_of(2, 20), max_tokens=20, arrival_time=1.0, priority=0))
    for _ in range(6):  # "a" decodes positions 10..15 in its block, "b" is admitted with the other two
        core.step()
    assert [r.request_id for r in core.scheduler.running] == ["a", "b"]
    assert core.scheduler.kv_cache_manager.get_num_free_blocks() == 0
    core.step()  # "a" needs a second block for position 16: it is the least important, so it goes
    so = ex.outputs[-1]
    assert so.preempted_req_ids == ["a"] and so.num_scheduled_tokens == {}
    results = run(core, ex)
    for rid, seed, n in (("a", 1, 10), ("b", 2, 20)):
        assert results.tokens[rid] == expected_tokens(prompt_of(seed, n), 20)
    assert_pool_empty(core)


def test_priority_admits_by_priority_then_arrival():
    core, ex = make_core(max_num_seqs=1, policy="priority")
    specs = [("w1", 5, 0.0), ("w2", 1, 3.0), ("w3", 1, 2.0), ("w4", 0, 9.0), ("w5", 5, -1.0)]
    for rid, prio, t in specs:
        core.add_request(make_request(rid, prompt_of(len(rid) + int(t), 10), max_tokens=2, arrival_time=t, priority=prio))
    run(core, ex)
    order = [new.req_id for so in ex.outputs for new in so.scheduled_new_reqs]
    assert order == ["w4", "w3", "w2", "w5", "w1"]
    assert_pool_empty(core)


def test_fcfs_admits_in_arrival_order_and_the_head_blocks_the_queue():
    # the head needs the whole pool; the small ones behind it must not overtake it
    core, ex = make_core(num_blocks=12, max_model_len=176, budget=512)
    core.add_request(make_request("run", prompt_of(1, 16), max_tokens=3))
    core.step()
    core.add_request(make_request("head", prompt_of(2, 170), max_tokens=1))
    core.add_request(make_request("small", prompt_of(3, 5), max_tokens=1))
    core.step()
    assert [new.req_id for new in ex.outputs[-1].scheduled_new_reqs] == []
    run(core, ex)
    order = [new.req_id for so in ex.outputs for new in so.scheduled_new_reqs]
    assert order == ["run", "head", "small"]
    assert_pool_empty(core)


# ---- finishing ------------------------------------------------------------------------------


def test_finish_on_max_tokens():
    core, ex = make_core()
    prompt = prompt_of(4, 20)
    core.add_request(make_request("m", prompt, max_tokens=7))
    results = run(core, ex)
    assert results.finish["m"] == "length" and results.tokens["m"] == expected_tokens(prompt, 7)


def test_finish_on_stop_token_ids():
    core, ex = make_core()
    prompt = prompt_of(4, 20)
    full = expected_tokens(prompt, 10)
    stop = full[3]
    want = expected_tokens(prompt, 10, stop={stop})
    core.add_request(make_request("s", prompt, max_tokens=10, stop_token_ids=[stop]))
    results = run(core, ex)
    assert results.finish["s"] == "stop" and results.tokens["s"] == want and want[-1] == stop and len(want) <= 4


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_finish_on_eos_unless_ignore_eos(ignore_eos):
    prompt = prompt_of(8, 20)
    eos = expected_tokens(prompt, 10)[4]
    core, ex = make_core(eos_token_ids=[eos])
    core.add_request(make_request("e", prompt, max_tokens=10, ignore_eos=ignore_eos))
    results = run(core, ex)
    if ignore_eos:
        assert results.finish["e"] == "length" and results.tokens["e"] == expected_tokens(prompt, 10)
    else:
        assert results.finish["e"] == "stop" and results.tokens["e"] == expected_tokens(prompt, 10, stop={eos})
        assert results.tokens["e"][-1] == eos
    assert_pool_empty(core)


@pytest.mark.parametrize("prompt_len", [60, 63, 64])
def test_finish_on_max_model_len(prompt_len):
    core, ex = make_core(max_model_len=64)
    prompt = prompt_of(2, prompt_len)
    core.add_request(make_request("l", prompt, max_tokens=100))
    results = run(core, ex)
    n = max(64 - prompt_len, 1)  # prompt + outputs never exceed max_model_len, but at least one token
    assert results.finish["l"] == "length" and results.tokens["l"] == expected_tokens(prompt, n)
    assert_pool_empty(core)


# ---- abort ----------------------------------------------------------------------------------


def test_abort_running_and_waiting_frees_at_once():
    core, ex = make_core(num_blocks=40, max_model_len=256, budget=64, max_num_seqs=2)
    for i in range(4):
        core.add_request(make_request(f"r{i}", prompt_of(i, 100), max_tokens=50))
    for _ in range(4):
        core.step()
    sched = core.scheduler
    running = [r.request_id for r in sched.running]
    waiting = [r.request_id for r in sched.waiting]
    assert running == ["r0", "r1"] and waiting == ["r2", "r3"]
    free_before = sched.kv_cache_manager.get_num_free_blocks()
    core.abort_requests(["r1", "r3", "nope"])  # a running, a waiting and an unknown id
    assert sched.kv_cache_manager.get_num_free_blocks() > free_before
    assert [r.request_id for r in sched.running] == ["r0"] and [r.request_id for r in sched.waiting] == ["r2"]
    out = core.step()
    aborted = {o.request_id: o for o in out.outputs if o.finish_reason == "abort"}
    assert set(aborted) == {"r1", "r3"} and all(not o.new_token_ids for o in aborted.values())
    assert "r1" in ex.outputs[-1].finished_req_ids and "r1" not in ex.block_tables
    core.abort_requests(["r0", "r2"])
    assert sched.kv_cache_manager.get_num_free_blocks() == core.kv_cache_config.num_blocks - 1
    assert_pool_empty(core)
    results = run(core, ex)
    assert results.finish == {f"r{i}": "abort" for i in range(4)}


def test_abort_of_a_preempted_request():
    core, ex = make_core(num_blocks=9, max_model_len=80, budget=256)
    for i, rid in enumerate(["x", "b", "a"]):
        core.add_request(make_request(rid, prompt_of(i + 1, 32), max_tokens=40, arrival_time=float(i)))
        core.step()
    core.step()
    assert ex.outputs[-1].preempted_req_ids == ["a"]
    core.abort_requests(["a"])
    results = run(core, ex)
    assert results.finish == {"x": "length", "b": "length", "a": "abort"}
    assert_pool_empty(core)


# ---- rejection ------------------------------------------------------------------------------


def test_rejections_give_an_error_and_disturb_nothing():
    prompt = prompt_of(6, 40)
    core, ex = make_core(num_blocks=60, max_model_len=128)
    core.add_request(make_request("ok", prompt, max_tokens=20))
    core.step()
    blocks_before = core.scheduler.kv_cache_manager.get_num_free_blocks()
    bad = {
        "empty": [],
        "too-long": prompt_of(1, 129),
        "vocab-high": [1, 2, VOCAB],
        "vocab-negative": [1, -1, 2],
    }
    for rid, p in bad.items():
        core.add_request(make_request(rid, p, max_tokens=1))
    core.add_request(make_request("ok", prompt_of(7, 10), max_tokens=1))  # duplicate of a running id
    assert core.scheduler.kv_cache_manager.get_num_free_blocks() == blocks_before
    assert [r.request_id for r in core.scheduler.running] == ["ok"] and not len(core.scheduler.waiting)
    out = core.step().outputs
    errors = [o for o in out if o.finish_reason == "error"]
    assert sorted(o.request_id for o in errors) == sorted([*bad, "ok"])
    assert all(o.error and not o.new_token_ids for o in errors)
    assert "already in use" in core.results.errors["ok"]
    assert "empty" in core.results.errors["empty"] and "max_model_len" in core.results.errors["too-long"]
    assert "vocabulary" in core.results.errors["vocab-high"] and "vocabulary" in core.results.errors["vocab-negative"]
    results = run(core, ex)
    assert results.tokens["ok"] == expected_tokens(prompt, 20) and results.finish["ok"] == "length"
    assert_pool_empty(core)


def test_prompt_of_exactly_max_model_len_is_accepted():
    core, ex = make_core(max_model_len=64)
    core.add_request(make_request("edge", prompt_of(1, 64), max_tokens=5))
    results = run(core, ex)
    assert results.finish["edge"] == "length" and len(results.tokens["edge"]) == 1


def test_request_larger_than_the_whole_cache_is_rejected():
    # EngineCore refuses a max_model_len the cache cannot hold, so build the scheduler directly.
    kv = KVCacheConfig(num_blocks=11, kv_cache_groups=[KVCacheGroupSpec(["layer.0"], SPEC)])  # 10 usable
    sched = Scheduler(engine_config(max_num_batched_tokens=64), kv, 1000, vocab_size=VOCAB)

    ok = sched.add_request(make_request("fits", prompt_of(1, 100), max_tokens=60))  # 160 tokens = 10 blocks
    big = sched.add_request(make_request("big", prompt_of(2, 100), max_tokens=61))  # 161 tokens = 11 blocks
    huge = sched.add_request(make_request("huge", prompt_of(3, 200), max_tokens=1))
    assert ok is None
    for out, rid in ((big, "big"), (huge, "huge")):
        assert out.request_id == rid and out.finish_reason == "error" and "whole cache" in out.error
    assert list(sched.requests) == ["fits"]
    # "fits" runs to completion alone in the whole cache
    outs = []
    for _ in range(200):
        if not sched.has_requests():
            break
        so = sched.schedule()
        outs += sched.update_from_output(so, _sample_all(so, sched))
    assert sched.kv_cache_manager.get_num_free_blocks() == 10
    assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 60


def _sample_all(so, sched) -> ModelRunnerOutput:
    """A minimal model runner: a token for each request whose prompt is now fully computed."""
    ids, sampled = [], []
    for rid in so.num_scheduled_tokens:
        r = sched.requests[rid]
        ids.append(rid)
        sampled.append([7] if r.num_computed_tokens >= r.num_tokens else [])
    return ModelRunnerOutput(so.step, ids, sampled)


# ---- empty steps ----------------------------------------------------------------------------


def test_empty_schedule_is_valid():
    kv = KVCacheConfig(num_blocks=20, kv_cache_groups=[KVCacheGroupSpec(["layer.0"], SPEC)])
    sched = Scheduler(engine_config(), kv, 128, vocab_size=VOCAB)
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0 and not so.num_scheduled_tokens and not so.scheduled_new_reqs
    assert sched.update_from_output(so, ModelRunnerOutput(so.step, [], [])) == []
    # a running request with nothing left to compute (its runner sampled nothing) gives an empty step too
    assert sched.add_request(make_request("r", prompt_of(1, 20), max_tokens=3)) is None
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"r": 20}
    assert sched.update_from_output(so, ModelRunnerOutput(so.step, ["r"], [[]])) == []
    step = sched.step
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0 and sched.step == step
    sched.abort_requests(["r"])
    assert sched.kv_cache_manager.get_num_free_blocks() == 19


def test_stats_after_a_workload():
    core, ex = make_core(num_blocks=24, max_model_len=256, budget=256)
    reqs = _workload(seed=11, n=8)
    for rid, prompt, max_tokens in reqs:
        core.add_request(make_request(rid, prompt, max_tokens=max_tokens))
    core.step()
    stats = core.get_stats()
    assert stats.num_running_reqs + stats.num_waiting_reqs == len(reqs)
    assert stats.kv_cache_usage == 1 - stats.num_free_blocks / 23
    assert stats.num_blocks_held == 23 - stats.num_free_blocks
    run(core, ex)
    stats = core.get_stats()
    assert stats.num_generation_tokens == sum(m for _, _, m in reqs)
    assert stats.num_prompt_tokens == sum(len(p) for _, p, _ in reqs)
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0 and stats.kv_cache_usage == 0.0
    assert stats.step == len(ex.outputs)
