"""long_prefill_token_threshold and enable_chunked_prefill, with the semantics of vLLM's v1 scheduler.

Driven through EngineCore + ReferenceExecutor (block-table digests on). The threshold caps the
tokens a request gets in one step, running or being admitted, counted after any prefix hit. With
chunked prefill off, a waiting request whose uncomputed tokens (after the threshold cap) exceed the
remaining budget is not split: admissions stop there for this step (no request behind it overtakes).
"""

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine_core.core import EngineCore
from engine_core.kv_cache.planning import KVCacheSizingError
from protocol import SchedulerOutput
from protocol.config import engine_config
from tests.engine_core.scheduler_support import (
    RecordingExecutor,
    assert_pool_empty,
    check_step_limits,
    expected_tokens,
    make_core,
    make_request,
    prompt_of,
    run,
)


def steps(ex: RecordingExecutor, start: int = 0) -> list[dict[str, int]]:
    """Scheduled tokens per request of every step that scheduled any."""
    return [dict(so.num_scheduled_tokens) for so in ex.outputs[start:] if so.num_scheduled_tokens]


def add_all(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int) -> None:
    for i, (rid, prompt) in enumerate(prompts.items()):
        core.add_request(make_request(rid, prompt, max_tokens=max_tokens, arrival_time=float(i)))


def assert_greedy_tokens(results, prompts: dict[str, list[int]], max_tokens: int) -> None:
    """The same tokens as with any other schedule: the reference executor's tokens for each prompt."""
    for rid, prompt in prompts.items():
        assert results.tokens[rid] == expected_tokens(prompt, max_tokens), rid
        assert results.finish[rid] == "length"


def check_flags(core: EngineCore, so: SchedulerOutput) -> None:
    """Every scheduled request gets min(uncomputed, threshold) tokens unless the budget ran out on it;
    with chunked prefill off, an admitted request is never cut by the budget."""
    config = core.config.scheduler
    # off in a step where one request runs or waits (schedule() moves requests, it finishes none)
    alone = len(core.scheduler.running) + len(core.scheduler.waiting) <= 1
    threshold = 0 if alone else config.long_prefill_token_threshold
    new_ids = {r.req_id for r in so.scheduled_new_reqs}
    for rid, n in so.num_scheduled_tokens.items():
        request = core.scheduler.requests[rid]  # already advanced by n; outputs not yet appended
        uncomputed = request.num_tokens - request.num_computed_tokens + n
        want = min(uncomputed, threshold) if threshold else uncomputed
        assert n <= want, (rid, n, want)
        if n < want:
            assert so.total_num_scheduled_tokens == config.max_num_batched_tokens, (rid, n, want)
            assert config.enable_chunked_prefill or rid not in new_ids, (rid, n, want)


# ---- long_prefill_token_threshold -----------------------------------------------------------


def test_threshold_400_splits_the_budget_over_three_long_prompts():
    core, ex = make_core(budget=1024, long_prefill_token_threshold=400)
    prompts = {rid: prompt_of(seed, 800) for seed, rid in enumerate("abc")}
    add_all(core, prompts, max_tokens=3)
    results = run(core, ex)
    assert steps(ex) == [
        {"a": 400, "b": 400, "c": 224},  # vLLM's first step
        {"a": 400, "b": 400, "c": 224},  # running ones again: c is capped by the budget, not the threshold
        {"a": 1, "b": 1, "c": 352},
        {"a": 1, "b": 1, "c": 1},
        {"c": 1},
    ]
    assert_greedy_tokens(results, prompts, 3)
    assert_pool_empty(core)


def test_threshold_is_off_for_a_request_with_nobody_to_starve():
    """As vLLM: the cap protects other requests' share of the budget; a lone prompt takes the whole budget,
    and the cap comes back as soon as another request waits."""
    core, ex = make_core(budget=1024, long_prefill_token_threshold=100)
    prompts = {"a": prompt_of(1, 900), "b": prompt_of(2, 300)}
    core.add_request(make_request("a", prompts["a"], max_tokens=3))
    core.step()
    core.add_request(make_request("b", prompts["b"], max_tokens=3, arrival_time=1.0))
    results = run(core, ex)
    assert steps(ex)[:4] == [{"a": 900}, {"a": 1, "b": 100}, {"a": 1, "b": 100}, {"b": 100}]
    assert_greedy_tokens(results, prompts, 3)
    assert_pool_empty(core)


def test_without_threshold_the_first_prompt_takes_what_it_needs():
    core, ex = make_core(budget=1024)
    prompts = {rid: prompt_of(seed, 800) for seed, rid in enumerate("abc")}
    add_all(core, prompts, max_tokens=3)
    results = run(core, ex)
    assert steps(ex)[:2] == [{"a": 800, "b": 224}, {"a": 1, "b": 576, "c": 447}]
    assert_greedy_tokens(results, prompts, 3)


def test_threshold_counts_the_tokens_left_after_a_prefix_hit():
    core, ex = make_core(budget=1024, long_prefill_token_threshold=100)
    prefix = prompt_of(1, 640)  # 40 full blocks
    first = {"a": prefix + prompt_of(2, 10)}
    add_all(core, first, max_tokens=2)
    run(core, ex)
    seen = len(ex.outputs)
    later = {"b": prefix + prompt_of(3, 160), "c": prefix + prompt_of(4, 90)}
    add_all(core, later, max_tokens=2)
    results = run(core, ex)
    assert {r.req_id: r.num_computed_tokens for so in ex.outputs[seen:] for r in so.scheduled_new_reqs} == {
        "b": 640,
        "c": 640,
    }
    # b: 160 uncomputed after the hit, so 100 then 60; c: 90, under the threshold, in one go.
    assert steps(ex, seen) == [{"b": 100, "c": 90}, {"b": 60, "c": 1}, {"b": 1}]
    assert results.num_cached == {"a": 0, "b": 640, "c": 640}
    assert_greedy_tokens(results, {**first, **later}, 2)
    assert_pool_empty(core)


def test_threshold_applies_to_a_resumed_request_with_outputs():
    """A preempted request is recomputed from its prompt plus outputs, threshold tokens a step."""
    core, ex = make_core(num_blocks=9, max_model_len=128, budget=256, long_prefill_token_threshold=24)
    prompts = {"a": prompt_of(1, 40), "b": prompt_of(2, 40), "c": prompt_of(3, 20)}  # 8 usable blocks
    add_all(core, prompts, max_tokens=60)
    alone: dict[int, bool] = {}  # per step: one request running or waiting, so the threshold is off

    def on_execute(so: SchedulerOutput) -> None:
        check_flags(core, so)
        alone[so.step] = len(core.scheduler.running) + len(core.scheduler.waiting) <= 1

    ex.on_execute = on_execute
    results = run(core, ex)
    assert core.get_stats().num_preemptions > 0
    resumed = [
        (so.num_scheduled_tokens[r.req_id], r.num_computed_tokens, len(r.prompt_token_ids) + len(r.output_token_ids))
        for so in ex.outputs
        for r in so.scheduled_new_reqs
        if r.output_token_ids and not alone[so.step]
    ]
    assert resumed and all(n == 24 < total - computed for n, computed, total in resumed)  # computed: a prefix hit
    assert_greedy_tokens(results, prompts, 60)
    assert_pool_empty(core)


# ---- enable_chunked_prefill=False -----------------------------------------------------------


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_off_admits_only_what_fits_whole(chunked):
    core, ex = make_core(budget=1024, enable_chunked_prefill=chunked)
    prompts = {"a": prompt_of(1, 800), "b": prompt_of(2, 800)}
    add_all(core, prompts, max_tokens=2)
    results = run(core, ex)
    if chunked:
        assert steps(ex) == [{"a": 800, "b": 224}, {"a": 1, "b": 576}, {"b": 1}]
    else:  # vLLM: only the first; b waits for a step with room for all 800 tokens
        assert steps(ex) == [{"a": 800}, {"a": 1, "b": 800}, {"b": 1}]
    assert_greedy_tokens(results, prompts, 2)
    assert_pool_empty(core)


def test_chunked_prefill_off_stops_admissions_at_the_first_that_does_not_fit():
    """vLLM breaks out of the waiting queue: a short prompt behind the long one does not overtake it."""
    core, ex = make_core(budget=1024, enable_chunked_prefill=False)
    prompts = {"a": prompt_of(1, 800), "b": prompt_of(2, 800), "c": prompt_of(3, 100)}
    add_all(core, prompts, max_tokens=2)
    results = run(core, ex)
    assert steps(ex) == [{"a": 800}, {"a": 1, "b": 800, "c": 100}, {"b": 1, "c": 1}]
    assert_greedy_tokens(results, prompts, 2)


def test_chunked_prefill_off_fits_the_tokens_left_after_a_prefix_hit():
    core, ex = make_core(budget=1024, enable_chunked_prefill=False)
    prefix = prompt_of(1, 640)
    prompts = {"a": prefix + prompt_of(2, 160), "b": prefix + prompt_of(3, 160), "c": prompt_of(4, 800)}
    add_all(core, prompts, max_tokens=2)
    results = run(core, ex)
    # b hits a's 640 just-computed tokens in the same step: its 160 fit the 224 left; c's 800 do not.
    assert steps(ex) == [{"a": 800, "b": 160}, {"a": 1, "b": 1, "c": 800}, {"c": 1}]
    assert results.num_cached == {"a": 0, "b": 640, "c": 0}
    assert_greedy_tokens(results, prompts, 2)


def test_chunked_prefill_off_with_threshold_admits_threshold_chunks():
    """As in vLLM, the threshold caps first; the fit check then sees the capped count."""
    core, ex = make_core(budget=1024, enable_chunked_prefill=False, long_prefill_token_threshold=300)
    prompts = {"a": prompt_of(1, 800), "b": prompt_of(2, 800), "c": prompt_of(3, 800)}
    add_all(core, prompts, max_tokens=2)
    results = run(core, ex)
    assert steps(ex)[:2] == [{"a": 300, "b": 300, "c": 300}, {"a": 300, "b": 300, "c": 300}]
    assert_greedy_tokens(results, prompts, 2)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_chunked_prefill_off_under_preemption_resumes_whole(policy):
    rng = random.Random(11)
    core, ex = make_core(num_blocks=24, max_model_len=256, budget=256, policy=policy, enable_chunked_prefill=False)
    prompts = {f"q{i}": prompt_of(100 + i, rng.randint(5, 120)) for i in range(12)}
    for i, (rid, prompt) in enumerate(prompts.items()):
        core.add_request(make_request(rid, prompt, max_tokens=40, arrival_time=float(i), priority=i % 3))
    ex.on_execute = lambda so: check_flags(core, so)
    results = run(core, ex)
    assert core.get_stats().num_preemptions > 0
    for so in ex.outputs:  # every admission, resumed ones included, gets all its uncomputed tokens
        for r in so.scheduled_new_reqs:
            total = len(r.prompt_token_ids) + len(r.output_token_ids)
            assert r.num_computed_tokens + so.num_scheduled_tokens[r.req_id] == total
    assert_greedy_tokens(results, prompts, 40)
    assert_pool_empty(core)


# ---- start-up check -------------------------------------------------------------------------


def test_start_up_refuses_max_model_len_above_the_budget_without_chunked_prefill():
    def start(**settings):
        ex = RecordingExecutor(max_position_embeddings=2048)
        return EngineCore(engine_config(max_num_batched_tokens=1024, num_gpu_blocks_override=400, **settings), ex)

    with pytest.raises(KVCacheSizingError, match="--max-model-len 2048 is larger than --max-num-batched-tokens 1024"):
        start(max_model_len=2048, enable_chunked_prefill=False)
    with pytest.raises(KVCacheSizingError, match="chunked prefill off"):  # resolved from the model's positions
        start(enable_chunked_prefill=False)
    assert start(max_model_len=1024, enable_chunked_prefill=False).max_model_len == 1024
    assert start(max_model_len=2048).max_model_len == 2048


# ---- property -------------------------------------------------------------------------------

MAX_MODEL_LEN = 128
PREFIXES = [prompt_of(901, 48), prompt_of(902, 20)]


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 12),
    threshold=st.one_of(st.just(0), st.integers(1, 150)),
    chunked=st.booleans(),
    budget=st.integers(8, 300),
    num_blocks=st.integers(10, 40),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_workload_keeps_threshold_budget_and_greedy_tokens(
    seed, n, threshold, chunked, budget, num_blocks, max_num_seqs, policy
):
    if not chunked:
        budget = MAX_MODEL_LEN + budget % 32  # the start-up rule; a tight budget makes prompts wait
    core, ex = make_core(
        num_blocks=num_blocks,
        max_model_len=MAX_MODEL_LEN,
        budget=budget,
        max_num_seqs=max_num_seqs,
        policy=policy,
        long_prefill_token_threshold=threshold,
        enable_chunked_prefill=chunked,
    )

    def on_execute(so: SchedulerOutput) -> None:
        check_step_limits(core, so)  # the budget and max_num_seqs, also in the steps between additions
        check_flags(core, so)

    ex.on_execute = on_execute
    rng = random.Random(seed)
    wanted = {}
    for i in range(n):
        prompt = prompt_of(seed % 1000 + i, rng.randint(1, 100))
        if rng.random() < 0.5:
            prompt = (rng.choice(PREFIXES) + prompt)[:MAX_MODEL_LEN]
        max_tokens = rng.randint(1, 40)
        wanted[f"r{i}"] = (prompt, min(max_tokens, max(MAX_MODEL_LEN - len(prompt), 1)))
        core.add_request(make_request(f"r{i}", prompt, max_tokens=max_tokens, arrival_time=float(i), priority=i % 3))
        for _ in range(rng.randint(0, 3)):
            core.step()
    results = run(core, ex)
    for rid, (prompt, n_out) in wanted.items():
        if rid not in results.errors:  # rejected: needs more blocks than the whole pool
            assert results.tokens[rid] == expected_tokens(prompt, n_out), rid
    event(f"preemptions: {'some' if core.get_stats().num_preemptions else 'none'}")
    capped = threshold and any(threshold in so.num_scheduled_tokens.values() for so in ex.outputs)
    event(f"threshold reached: {'yes' if capped else 'no'}")
    assert_pool_empty(core)
