"""Random workloads through EngineCore + ReferenceExecutor over a small pool.

After every step, replaying the SchedulerOutputs on a plain dict of block tables (independent of
ReferenceExecutor: overwrite on new, append on cached, drop on finished/preempted) must give
exactly kv_cache_manager.get_block_ids() of every running request.
"""

import random

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from protocol import SchedulerOutput
from tests.engine_core.scheduler_support import (
    BLOCK_SIZE,
    assert_pool_empty,
    cdiv,
    check_step_limits,
    expected_tokens,
    make_core,
    make_request,
    prompt_of,
)

MAX_MODEL_LEN = 128  # 8 blocks of 16
PREFIXES = [prompt_of(901, 48), prompt_of(902, 20), prompt_of(903, 33)]


class Replayer:
    """A worker's view of block tables and computed tokens, rebuilt from SchedulerOutputs only."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}
        self.ever_seen: set[str] = set()

    def apply(self, so: SchedulerOutput) -> None:
        for rid in [*so.finished_req_ids, *so.preempted_req_ids]:
            self.tables.pop(rid, None)
            self.computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            # a resumed request must have been dropped first (its preemption reached us)
            assert new.req_id not in self.tables, f"{new.req_id} sent as new while the worker still holds it"
            self.tables[new.req_id] = [list(g) for g in new.block_ids]
            self.computed[new.req_id] = new.num_computed_tokens
            self.ever_seen.add(new.req_id)
        cached = so.scheduled_cached_reqs
        for rid, ids, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            assert rid in self.tables, f"{rid} scheduled as cached but the worker does not hold it"
            assert computed == self.computed[rid]
            if ids is not None:
                for table, more in zip(self.tables[rid], ids):
                    table.extend(more)
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] += n


add_op = st.tuples(
    st.just("add"),
    st.integers(1, 100),  # prompt length (before any prefix)
    st.integers(1, 60),  # max_tokens
    st.sampled_from([None, 0, 1, 2]),  # shared prefix, most of the time
    st.integers(0, 3),  # priority
)
ops = st.lists(
    st.one_of(
        add_op,
        add_op,
        st.tuples(st.just("abort"), st.integers(0, 10_000)),
        st.tuples(st.just("step"), st.integers(1, 8)),
    ),
    min_size=4,
    max_size=30,
)


def drive(ops, num_blocks, budget, max_num_seqs, policy, prefix_caching, **config_kwargs) -> None:
    """Apply the ops to a fresh EngineCore, checking everything after every step, then drain it."""
    core, ex = make_core(
        num_blocks=num_blocks,
        max_model_len=MAX_MODEL_LEN,
        budget=budget,
        max_num_seqs=max_num_seqs,
        policy=policy,
        prefix_caching=prefix_caching,
        **config_kwargs,
    )
    manager = core.scheduler.kv_cache_manager
    replay = Replayer()

    def check_running() -> None:
        for r in core.scheduler.running:
            assert replay.tables[r.request_id] == manager.get_block_ids(r.request_id), r.request_id
            assert replay.computed[r.request_id] == r.num_computed_tokens

    def on_execute(so: SchedulerOutput) -> None:
        check_step_limits(core, so)
        replay.apply(so)
        check_running()  # the ledger right after schedule(), before any finish frees blocks
        for new in so.scheduled_new_reqs:
            total = new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]
            assert [len(g) for g in new.block_ids] == [cdiv(total, BLOCK_SIZE)]

    ex.on_execute = on_execute
    added: dict[str, tuple[list[int], int]] = {}
    accepted: list[str] = []

    def step() -> None:
        core.step()
        assert len(core.scheduler.running) <= max_num_seqs
        check_running()
        assert manager.get_num_free_blocks() + len(
            {b for r in core.scheduler.running for b in manager.get_block_ids(r.request_id)[0]}
        ) <= num_blocks - 1

    for n, op in enumerate(ops):
        if op[0] == "add":
            _, length, max_tokens, prefix, priority = op
            prompt = prompt_of(n, length)
            if prefix is not None:
                prompt = (PREFIXES[prefix] + prompt)[:MAX_MODEL_LEN]
            rid = f"r{n}"
            added[rid] = (prompt, max_tokens)
            core.add_request(make_request(rid, prompt, max_tokens=max_tokens, arrival_time=float(n), priority=priority))
            if rid in core.scheduler.requests:
                accepted.append(rid)
        elif op[0] == "abort" and accepted:
            core.abort_requests([accepted[op[1] % len(accepted)]])
        else:
            for _ in range(op[1]):
                step()

    for _ in range(5_000):
        if not core.has_work():
            break
        step()
    assert not core.has_work()

    results = core.results
    for rid, (prompt, max_tokens) in added.items():
        if rid in results.errors:  # only requests that can never fit are rejected
            assert rid not in accepted
            continue
        reason = results.finish[rid]
        if reason == "abort":
            want = expected_tokens(prompt, max_tokens)
            assert results.tokens.get(rid, []) == want[: len(results.tokens.get(rid, []))]
        else:
            assert reason == "length"
            n_out = min(max_tokens, max(MAX_MODEL_LEN - len(prompt), 1))
            assert results.tokens[rid] == expected_tokens(prompt, n_out)
    assert set(results.finish) == set(accepted)
    stats = core.get_stats()
    event(f"preemptions: {'some' if stats.num_preemptions else 'none'}")
    event(f"prefix hits: {'some' if stats.prefix_cache_hits else 'none'}")
    event(f"aborts: {'some' if 'abort' in results.finish.values() else 'none'}")
    assert_pool_empty(core)
    assert replay.tables == {} and ex.block_tables == {}


@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(9, 24),
    budget=st.integers(8, 160),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix_caching=st.booleans(),
)
def test_random_workload_ledger_and_scheduler_outputs_agree(ops, num_blocks, budget, max_num_seqs, policy, prefix_caching):
    drive(ops, num_blocks, budget, max_num_seqs, policy, prefix_caching)


def seeded_ops(seed: int, n: int) -> list[tuple]:
    """Op lists of the same shape, drawn from a seed: hypothesis' own draws favour tiny workloads
    that rarely fill the pool, these fill it (and preempt) most of the time."""
    rng = random.Random(seed)
    out: list[tuple] = []
    for _ in range(n):
        x = rng.random()
        if x < 0.6:
            out.append(("add", rng.randint(1, 100), rng.randint(1, 60), rng.choice([None, 0, 0, 1, 2]), rng.randint(0, 3)))
        elif x < 0.7:
            out.append(("abort", rng.randint(0, 10_000)))
        else:
            out.append(("step", rng.randint(1, 8)))
    return out


@pytest.mark.parametrize("async_scheduling", [False, True])  # async: step N+1 sent before step N is applied
@settings(max_examples=80, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(4, 30),
    num_blocks=st.integers(9, 24),
    budget=st.integers(8, 160),
    max_num_seqs=st.integers(2, 8),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix_caching=st.sampled_from([True, True, False]),
)
def test_seeded_random_workload_ledger_and_scheduler_outputs_agree(
    async_scheduling, seed, n, num_blocks, budget, max_num_seqs, policy, prefix_caching
):
    drive(seeded_ops(seed, n), num_blocks, budget, max_num_seqs, policy, prefix_caching,
          async_scheduling=async_scheduling)
