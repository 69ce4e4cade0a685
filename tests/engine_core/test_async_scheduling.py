"""Async scheduling: step N+1 is scheduled and sent before step N's output is applied (vLLM's
AsyncScheduler behind a batch queue of two). The tokens every request gets must not change; what
changes is when the ledger decides, and a request that stops is computed one step more. Random workloads
in async mode: test_scheduler_hypothesis.py; against vLLM's own AsyncScheduler:
tests/conformance/test_vllm_decisions.py."""

from protocol import SchedulerOutput
from tests.engine_core.scheduler_support import (
    assert_pool_empty,
    expected_tokens,
    make_core,
    make_request,
    prompt_of,
    run,
)


def journal(ex) -> list[tuple[str, int]]:
    """Wrap the executor's submit and collect: the order of ('submit' | 'collect', step)."""
    log: list[tuple[str, int]] = []
    submit, collect = ex.submit, ex.collect

    def logged_submit(so: SchedulerOutput) -> None:
        log.append(("submit", so.step))
        submit(so)

    def logged_collect(so: SchedulerOutput):
        log.append(("collect", so.step))
        return collect(so)

    ex.submit, ex.collect = logged_submit, logged_collect
    return log


def steps_of(ex, req_id: str) -> int:
    return sum(req_id in so.num_scheduled_tokens for so in ex.outputs)


def test_step_n_plus_1_is_sent_before_step_n_is_applied():
    core, ex = make_core(async_scheduling=True)
    log = journal(ex)
    prompt = prompt_of(1, 20)
    core.add_request(make_request("a", prompt, max_tokens=4))
    core.step()
    request = core.scheduler.requests["a"]
    assert log == [("submit", 1)] and request.num_output_placeholders == 1 and not request.output_token_ids
    core.step()  # step 2 goes out feeding the token step 1 is still sampling; then step 1 is applied
    assert log == [("submit", 1), ("submit", 2), ("collect", 1)]
    assert ex.outputs[1].scheduled_cached_reqs.num_computed_tokens == [20]
    assert ex.outputs[1].num_scheduled_tokens == {"a": 1}
    assert request.output_token_ids == expected_tokens(prompt, 1) and request.num_output_placeholders == 1
    calls = []  # what each later step() call sent and applied
    while core.has_work():
        start = len(log)
        core.step()
        calls.append(log[start:])
    # step 4 samples the last token: the schedule beside it is empty, is never sent, but takes a place in the
    # queue (as in vLLM's batch queue), so step 5, which only tells the workers "a" finished, is applied a call later
    assert calls == [[("submit", 3), ("collect", 2)], [("submit", 4), ("collect", 3)], [("collect", 4)],
                     [("submit", 5)], [("collect", 5)]]
    results = core.results
    assert ex.outputs[-1].finished_req_ids == ["a"] and ex.outputs[-1].total_num_scheduled_tokens == 0
    assert results.tokens["a"] == expected_tokens(prompt, 4) and results.finish["a"] == "length"
    assert_pool_empty(core)


def test_a_request_at_its_length_limit_is_not_scheduled_again():
    """max_tokens and max_model_len: as many steps as without async scheduling, none wasted."""
    for async_scheduling in (False, True):
        core, ex = make_core(max_model_len=64, async_scheduling=async_scheduling)
        core.add_request(make_request("tokens", prompt_of(1, 20), max_tokens=5))
        core.add_request(make_request("model_len", prompt_of(2, 60), max_tokens=50))
        results = run(core, ex)
        assert results.tokens["tokens"] == expected_tokens(prompt_of(1, 20), 5)
        assert results.tokens["model_len"] == expected_tokens(prompt_of(2, 60), 4)
        assert (steps_of(ex, "tokens"), steps_of(ex, "model_len")) == (5, 4)
        assert_pool_empty(core)


def test_a_stop_token_costs_one_more_step_whose_token_is_dropped():
    prompt = prompt_of(3, 20)
    want = expected_tokens(prompt, 3)
    assert want[2] not in want[:2]
    counts = {}
    for async_scheduling in (False, True):
        core, ex = make_core(async_scheduling=async_scheduling)
        core.add_request(make_request("a", prompt, max_tokens=10, stop_token_ids=[want[2]]))
        results = run(core, ex)
        assert results.tokens["a"] == want and results.finish["a"] == "stop"
        counts[async_scheduling] = steps_of(ex, "a")
        assert "a" in ex.outputs[-1].finished_req_ids and "a" not in ex.token_ids  # the worker dropped it
        assert_pool_empty(core)
    assert counts == {False: 3, True: 4}


def preempting_core(stop_token_ids=None):
    """Two requests that outgrow a 5-block pool: the later one is preempted while a step of it runs."""
    core, ex = make_core(num_blocks=6, max_model_len=80, async_scheduling=True)
    sampled: dict[int, dict[str, list[int]]] = {}
    collect = ex.collect

    def recording_collect(so):
        out = collect(so)
        sampled[so.step] = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
        return out

    ex.collect = recording_collect
    core.add_request(make_request("a", prompt_of(4, 30), max_tokens=40))
    core.add_request(make_request("b", prompt_of(5, 30), max_tokens=40, stop_token_ids=stop_token_ids or []))
    return core, ex, sampled


def test_a_request_preempted_with_a_step_in_flight_keeps_that_steps_token():
    core, ex, sampled = preempting_core()
    results = run(core, ex)
    assert results.tokens["b"] == expected_tokens(prompt_of(5, 30), 40)
    assert results.tokens["a"] == expected_tokens(prompt_of(4, 30), 40)
    preempt = next(so for so in ex.outputs if "b" in so.preempted_req_ids)
    assert sampled[preempt.step - 1].get("b"), "b samples a token in the step in flight when it is preempted"
    resume = next(new for so in ex.outputs if so.step > preempt.step for new in so.scheduled_new_reqs
                  if new.req_id == "b")
    before = [t for step in range(1, preempt.step) for t in sampled[step].get("b", [])]
    assert resume.output_token_ids == before  # the in-flight step's token is appended, not recomputed
    assert_pool_empty(core)


def test_a_preempted_request_whose_step_in_flight_stops_it_finishes_from_the_waiting_queue():
    core, ex, sampled = preempting_core()
    run(core, ex)
    preempt = next(so for so in ex.outputs if "b" in so.preempted_req_ids)
    stop = sampled[preempt.step - 1]["b"][0]
    want = expected_tokens(prompt_of(5, 30), 40, stop={stop})
    assert want[-1] == stop and len(want) < 40

    core, ex, sampled = preempting_core(stop_token_ids=[stop])
    results = run(core, ex)
    assert results.tokens["b"] == want and results.finish["b"] == "stop"
    preempt = next(so for so in ex.outputs if "b" in so.preempted_req_ids)
    assert not any(new.req_id == "b" for so in ex.outputs if so.step > preempt.step for new in so.scheduled_new_reqs)
    assert results.tokens["a"] == expected_tokens(prompt_of(4, 30), 40)
    assert_pool_empty(core)


def test_an_id_taken_again_while_the_old_requests_step_runs_gets_only_its_own_tokens():
    prompt, other = prompt_of(6, 20), prompt_of(7, 25)
    want = expected_tokens(prompt, 2)
    core, ex = make_core(async_scheduling=True, check_block_tables=False)
    core.add_request(make_request("a", prompt, max_tokens=10, stop_token_ids=[want[1]]))
    while "a" not in core.results.finish:
        core.step()
    assert core.results.tokens["a"] == want and core.scheduler.requests == {}
    core.results.tokens.pop("a")
    core.results.finish.pop("a")
    core.add_request(make_request("a", other, max_tokens=3))  # step 3, still computing the old "a", is in flight
    while core.has_work():  # not run(): the step that admits the new "a" also tells the workers the old one finished
        core.step()
    results = core.results
    assert ["a"] == ex.outputs[3].finished_req_ids == [new.req_id for new in ex.outputs[3].scheduled_new_reqs]
    assert results.tokens["a"] == expected_tokens(other, 3) and results.finish["a"] == "length"
    assert_pool_empty(core)


def test_a_finished_request_leaves_the_same_cached_blocks_as_without_async_scheduling():
    """Its last step's block is hash-registered when that output is applied (no later step caches it)."""
    for prompt_len, max_tokens in [(20, 13), (15, 2), (16, 1), (31, 2), (20, 30)]:
        cached = []
        for async_scheduling in (False, True):
            core, ex = make_core(async_scheduling=async_scheduling)
            core.add_request(make_request("a", prompt_of(1, prompt_len), max_tokens=max_tokens))
            run(core, ex)
            cached.append(core.scheduler.kv_cache_manager.block_pool.num_cached_free_blocks)
        assert cached[0] == cached[1] == (prompt_len + max_tokens - 1) // 16, (prompt_len, max_tokens)
