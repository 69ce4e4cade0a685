"""Speculative decoding in the scheduler and the ledger, against the seed's rules for draft tokens.

A request with n-gram drafts is scheduled for 1 + len(drafts) tokens; the drafts' slots are allocated as
lookahead slots (allocate_slots(..., num_lookahead_tokens)), never hash-registered (caching stops at
request.num_tokens); the step's answer rolls num_computed_tokens back by the rejected drafts; blocks held for
rejected slots stay the request's (the next allocation asks for max(needed - held, 0)) and go back to the pool
with the request's other blocks. Scripted answers check each rule; random workloads (hypothesis) over the
reference executor, which verifies drafts greedily, check outputs equal plain decoding and that no block leaks.
"""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_core.executor.reference_executor import reference_next_token
from protocol import EngineCoreRequest, FullAttentionSpec, ModelRunnerOutput, SamplingParams, SchedulerOutput
from protocol.config import engine_config
from tests.engine_core.scheduler_support import (
    RecordingEngineCore,
    RecordingExecutor,
    assert_pool_empty,
    make_core,
    make_request,
    run,
)

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}'


def _answer(so: SchedulerOutput, rid: str, tokens: list[int]) -> ModelRunnerOutput:
    return ModelRunnerOutput(step=so.step, req_ids=[rid], sampled_token_ids=[tokens])


def _cached_blocks(core, rid: str) -> int:
    return core.scheduler.kv_cache_manager.coordinator.single_type_managers[0].num_cached_block.get(rid, 0)


def test_drafts_take_lookahead_slots_that_are_never_hashed_and_roll_back():
    core, _ = make_core(num_blocks=20, max_model_len=256, speculative_config=NGRAM)
    scheduler, manager = core.scheduler, core.scheduler.kv_cache_manager
    free_at_start = manager.get_num_free_blocks()
    scheduler.add_request(make_request("r", [1, 2] * 6 + [1], max_tokens=5))
    so = scheduler.schedule()  # the prompt: 13 tokens, no drafts
    assert so.num_scheduled_tokens == {"r": 13} and so.scheduled_spec_decode_tokens is None
    scheduler.update_from_output(so, _answer(so, "r", [2]))
    request = scheduler.requests["r"]

    so = scheduler.schedule()  # 14 tokens [1, 2] * 7: the suffix [1, 2] first occurred at 0, then came 1 2 1
    assert so.scheduled_spec_decode_tokens == {"r": [1, 2, 1]}
    assert so.num_scheduled_tokens == {"r": 4} and so.total_num_scheduled_tokens == 4  # the budget counts drafts
    assert request.num_computed_tokens == 17
    assert len(manager.get_block_ids("r")[0]) == 2  # slots 0..16: 14 tokens and 3 lookahead slots
    assert _cached_blocks(core, "r") == 0  # 14 tokens fill no block: the drafts' slots are not registered
    assert manager.get_blocks("r").blocks[0][1].block_hash is None

    scheduler.update_from_output(so, _answer(so, "r", [7]))  # all three rejected: the target's token instead
    assert request.num_computed_tokens == 14 and request.num_tokens == 15  # rolled back by 3
    assert request.spec_token_ids == []
    assert len(manager.get_block_ids("r")[0]) == 2  # the rejected slots' block stays the request's

    so = scheduler.schedule()  # suffix [7] never occurred: one token; the held block serves it (no new block)
    assert so.num_scheduled_tokens == {"r": 1} and so.scheduled_spec_decode_tokens is None
    assert so.scheduled_cached_reqs.new_block_ids == [None]
    scheduler.update_from_output(so, _answer(so, "r", [1]))

    so = scheduler.schedule()  # 16 tokens, suffix [7, 1]: no; [1]: first at 0 -> 2 1 2, capped at max_tokens
    assert so.scheduled_spec_decode_tokens == {"r": [2]}  # 3 outputs so far, max_tokens 5: 1 draft + 1 more
    assert _cached_blocks(core, "r") == 1  # 16 real tokens fill block 0: registered, block 1 not
    out = scheduler.update_from_output(so, _answer(so, "r", [2, 9]))  # the draft accepted, then the bonus token
    assert out[0].new_token_ids == [2, 9] and out[0].finish_reason == "length"
    assert manager.get_num_free_blocks() == free_at_start  # every block back, the rejected slots' too
    stats = core.get_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens) == (2, 4)
    assert stats.spec_decode_num_accepted_tokens == 1 and stats.spec_decode_num_accepted_tokens_per_pos == [1, 0, 0]


def test_stop_token_among_accepted_drafts_ends_there():
    core, _ = make_core(num_blocks=20, max_model_len=256, speculative_config=NGRAM)
    scheduler = core.scheduler
    scheduler.add_request(make_request("r", [4, 5, 6, 4, 5], max_tokens=10, stop_token_ids=[4]))
    so = scheduler.schedule()
    scheduler.update_from_output(so, _answer(so, "r", [6]))
    so = scheduler.schedule()  # suffix [5, 6] first at 1 -> 4 5 6
    assert so.scheduled_spec_decode_tokens == {"r": [4, 5, 6]}
    out = scheduler.update_from_output(so, _answer(so, "r", [4, 5, 6, 1]))
    assert out[0].new_token_ids == [6, 4][1:] and out[0].finish_reason == "stop"  # the tokens after 4 dropped
    assert_pool_empty(core)


def test_preemption_drops_drafts():
    core, _ = make_core(num_blocks=20, max_model_len=256, speculative_config=NGRAM)
    scheduler = core.scheduler
    scheduler.add_request(make_request("r", [1, 2] * 6 + [1], max_tokens=5))
    so = scheduler.schedule()
    scheduler.update_from_output(so, _answer(so, "r", [2]))
    so = scheduler.schedule()
    request = scheduler.requests["r"]
    assert request.spec_token_ids
    scheduler._preempt(request)
    assert request.spec_token_ids == [] and request.num_computed_tokens == 0


def _expected(prompt: list[int], n: int, vocab: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(reference_next_token(tokens, vocab))
    return tokens[len(prompt):]


class LedgerCheck:
    """At every step, while the ledger is as the scheduler left it: the seed's rules for the drafted requests."""

    def __init__(self, core) -> None:
        self.core, self.num_drafted_steps = core, 0

    def __call__(self, so: SchedulerOutput) -> None:
        scheduler = self.core.scheduler
        manager = scheduler.kv_cache_manager
        block_size = manager.hash_block_size
        for rid, drafts in (so.scheduled_spec_decode_tokens or {}).items():
            self.num_drafted_steps += 1
            request = scheduler.requests[rid]
            assert so.num_scheduled_tokens[rid] == 1 + len(drafts)
            blocks = manager.get_blocks(rid).blocks[0]
            assert len(blocks) * block_size >= request.num_computed_tokens  # the lookahead slots are allocated
            for block in blocks[request.num_tokens // block_size:]:  # nothing past the real tokens is registered
                assert block.block_hash is None
        for request in scheduler.running:
            assert _cached_blocks(self.core, request.request_id) * block_size <= request.num_tokens


@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), num_blocks=st.integers(12, 30), budget=st.sampled_from([8, 16, 64]),
       async_scheduling=st.booleans(), k=st.integers(1, 4))
def test_random_workloads_equal_plain_decoding_and_leak_nothing(seed, num_blocks, budget, async_scheduling, k):
    vocab = 6  # the reference tokens repeat often enough in a small vocabulary for drafts to be accepted
    spec = f'{{"method": "ngram", "num_speculative_tokens": {k}, "prompt_lookup_max": 3, "prompt_lookup_min": 1}}'
    executor = RecordingExecutor(kv_cache_specs={"layer.0": FullAttentionSpec(4, 1, 8, 2)}, vocab_size=vocab)
    config = engine_config(max_model_len=44, max_num_batched_tokens=budget, block_size=4, check_block_tables=True,
                           num_gpu_blocks_override=num_blocks, speculative_config=spec,
                           async_scheduling=async_scheduling)
    core = RecordingEngineCore(config, executor)
    check = LedgerCheck(core)
    executor.on_execute = check
    rng = random.Random(seed)
    prefix = [rng.randrange(1, vocab) for _ in range(9)]
    asked = {}
    for i in range(rng.randrange(1, 7)):
        prompt = (prefix if rng.random() < 0.5 else []) + [rng.randrange(1, vocab) for _ in range(rng.randrange(1, 14))]
        asked[f"r{i}"] = (prompt, rng.randrange(1, 21))
        core.add_request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=asked[f"r{i}"][1],
                                                                            temperature=0.0, ignore_eos=True), 0.0))
    results = run(core, executor)
    assert results.tokens == {rid: _expected(p, n, vocab) for rid, (p, n) in asked.items()}
    assert_pool_empty(core)
    stats = core.get_stats()
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    # async: a step in flight when its request is preempted brings stale tokens, not a verified draft count
    assert stats.spec_decode_num_drafts == check.num_drafted_steps or (
        async_scheduling and stats.spec_decode_num_drafts < check.num_drafted_steps)
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert all(a >= b for a, b in zip([stats.spec_decode_num_drafts, *per_pos], per_pos, strict=False))


def test_random_workloads_accept_and_reject_drafts_and_preempt():
    """The workloads above exercise what they claim: drafts accepted and rejected, preemptions, prefix hits."""
    vocab, rng = 6, random.Random(3)
    executor = RecordingExecutor(kv_cache_specs={"layer.0": FullAttentionSpec(4, 1, 8, 2)}, vocab_size=vocab)
    config = engine_config(max_model_len=44, max_num_batched_tokens=16, block_size=4, num_gpu_blocks_override=14,
                           speculative_config=NGRAM.replace('"prompt_lookup_max": 2', '"prompt_lookup_max": 3'))
    core = RecordingEngineCore(config, executor)
    prefix = [rng.randrange(1, vocab) for _ in range(9)]
    for i in range(6):
        core.add_request(make_request(f"r{i}", prefix + [rng.randrange(1, vocab) for _ in range(5)], max_tokens=20))
    run(core, executor)
    stats = core.get_stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
