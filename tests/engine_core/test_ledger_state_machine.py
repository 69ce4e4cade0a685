"""A hypothesis state machine that drives KVCacheManager like a scheduler and checks every docs/architecture.md
invariant after every step.

Four configurations: one full-attention group, and a hybrid full + sliding-window pair, each with and
without prefix caching. Pools are small (8-24 blocks, block size 2-4) and prompts come from a
3-token alphabet built on a few shared stems, so prefixes are shared, hits happen, free cached blocks
get evicted and allocations are refused often.
"""

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine_core.request import RequestStatus
from tests.engine_core.ledger_support import (
    EventMirror,
    cdiv,
    check_invariants,
    full_spec,
    make_manager,
    make_request,
    snapshot,
    swa_spec,
)

TOKENS = st.integers(min_value=0, max_value=2)
STEMS = [[0, 1, 2, 0, 1, 2, 0, 1], [1, 1, 1, 1, 2, 2], [2, 0, 2, 0]]
MAX_MODEL_LEN = 40


class LedgerMachine(RuleBasedStateMachine):
    HYBRID = False
    CACHING = True

    def __init__(self):
        super().__init__()
        self.mgr = None

    # ------------------------------------------------------------------ set-up

    @initialize(
        num_blocks=st.integers(8, 24),
        block_size=st.integers(2, 4),
        window_extra=st.integers(1, 6),
        watermark=st.sampled_from([0.0, 0.0, 0.1]),
        chunk_cap=st.integers(4, 16),
    )
    def setup(self, num_blocks, block_size, window_extra, watermark, chunk_cap):
        self.block_size = block_size
        specs = [full_spec(block_size)]
        if self.HYBRID:
            specs.append(swa_spec(block_size, window=block_size + window_extra))
        self.max_num_batched_tokens = chunk_cap
        self.mgr = make_manager(
            num_blocks,
            *specs,
            max_model_len=MAX_MODEL_LEN,
            enable_caching=self.CACHING,
            max_num_batched_tokens=chunk_cap,
            watermark=watermark,
            enable_kv_cache_events=True,
        )
        self.n = num_blocks
        self.requests = {}  # live requests (they may hold blocks) by id
        self.waiting = []  # ids of requests that hold no blocks
        self.running = []  # ids in admission order (newest last)
        self.next_id = 0
        self.mirror = EventMirror()

    # ------------------------------------------------------------------ helpers

    def _new_blocks_ok(self, out):
        """A successful allocation never hands out the null block and only fresh blocks."""
        for group in out.blocks:
            for b in group:
                assert not b.is_null and b.block_id != 0
                assert b.ref_cnt == 1

    def _pre_apply_window(self, req):
        """allocate_slots may drop blocks that left a sliding window even when it then returns None
        (the seed allows it: it only frees). Do that first, so the snapshot shows the count changed
        nothing else."""
        self.mgr.coordinator.remove_skipped_blocks(req.request_id, req.num_computed_tokens)

    def _refused(self, before):
        assert snapshot(self.mgr) == before, "allocate_slots returned None but changed the ledger"

    def _finish_prefill_if_done(self, req):
        if req.num_computed_tokens == req.num_tokens and req.num_tokens < MAX_MODEL_LEN:
            req.append_output_token_ids([self._next_token])

    def _in_prefill(self):
        return [r for r in self.running if self.requests[r].num_computed_tokens < self.requests[r].num_tokens]

    def _decodable(self):
        return [
            r
            for r in self.running
            if self.requests[r].num_computed_tokens == self.requests[r].num_tokens - 1
            and self.requests[r].num_tokens < MAX_MODEL_LEN
        ]

    # ------------------------------------------------------------------ rules

    @rule(data=st.data(), stem=st.integers(0, len(STEMS)), tail=st.lists(TOKENS, max_size=10), token=TOKENS)
    def add_request(self, data, stem, tail, token):
        """A request arrives and the scheduler tries to admit it at once."""
        prompt = (STEMS[stem] if stem < len(STEMS) else []) + tail
        if not prompt:
            prompt = [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.requests[rid] = make_request(rid, prompt[: MAX_MODEL_LEN - 1], block_size=self.block_size)
        self.waiting.append(rid)
        self._admit(rid, data, token)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), token=TOKENS)
    def admit(self, data, token):
        self._admit(data.draw(st.sampled_from(self.waiting), label="waiting"), data, token)

    def _admit(self, rid, data, token):
        req = self.requests[rid]
        hits, num_hit = self.mgr.get_computed_blocks(req)
        # A hit is whole blocks, never the last token, and every hit block carries the request's hash.
        assert num_hit % self.block_size == 0 and num_hit <= req.num_tokens - 1
        for group in hits.blocks:
            assert len(group) == num_hit // self.block_size
        if not self.CACHING:
            assert num_hit == 0
        remaining = req.num_tokens - num_hit
        chunk = data.draw(st.integers(1, remaining), label="chunk")
        before = snapshot(self.mgr)
        out = self.mgr.allocate_slots(
            req, chunk, num_hit, hits, full_sequence_must_fit=True, has_scheduled_reqs=bool(self.running)
        )
        event(f"admit hit={'yes' if num_hit else 'no'} {'refused' if out is None else 'ok'}")
        if out is None:
            self._refused(before)
            return
        self._new_blocks_ok(out)
        for group in self.mgr.get_blocks(rid).blocks:
            assert len(group) >= cdiv(num_hit + chunk, self.block_size)
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit + chunk
        self._next_token = token
        self._finish_prefill_if_done(req)
        self.waiting.remove(rid)
        self.running.append(rid)

    @precondition(lambda self: self.mgr is not None and self._in_prefill())
    @rule(data=st.data(), token=TOKENS)
    def allocate_chunk(self, data, token):
        rid = data.draw(st.sampled_from(self._in_prefill()), label="prefilling")
        req = self.requests[rid]
        chunk = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens), label="chunk")
        self._pre_apply_window(req)
        before = snapshot(self.mgr)
        out = self.mgr.allocate_slots(req, chunk, has_scheduled_reqs=True)
        if out is None:
            self._refused(before)
            return
        self._new_blocks_ok(out)
        req.num_computed_tokens += chunk
        self._next_token = token
        self._finish_prefill_if_done(req)

    @precondition(lambda self: self.mgr is not None and self._decodable())
    @rule(data=st.data(), token=TOKENS, lookahead=st.sampled_from([0, 0, 0, 1, 2]))
    def decode(self, data, token, lookahead):
        rid = data.draw(st.sampled_from(self._decodable()), label="decoding")
        req = self.requests[rid]
        self._pre_apply_window(req)
        before = snapshot(self.mgr)
        out = self.mgr.allocate_slots(req, 1, num_lookahead_tokens=lookahead, has_scheduled_reqs=True)
        event(f"decode {'refused' if out is None else 'ok'}")
        if out is None:
            self._refused(before)
            return
        self._new_blocks_ok(out)
        req.num_computed_tokens += 1
        req.append_output_token_ids([token])

    @precondition(lambda self: self.running)
    @rule(tokens=st.lists(TOKENS, min_size=1, max_size=6))
    def scheduler_steps(self, tokens):
        """A few scheduler steps: every running request gets its next chunk or decode slot, in order;
        when one cannot, the newest running request is preempted (recompute) and the step ends."""
        for token in tokens:
            for rid in list(self.running):
                if rid not in self.running:
                    continue
                req = self.requests[rid]
                if req.num_tokens >= MAX_MODEL_LEN:
                    continue
                num_new = min(req.num_tokens - req.num_computed_tokens, self.max_num_batched_tokens)
                self._pre_apply_window(req)
                before = snapshot(self.mgr)
                out = self.mgr.allocate_slots(req, num_new, has_scheduled_reqs=True)
                if out is None:
                    event("step refused -> preempt newest")
                    self._refused(before)
                    self.preempt_newest()
                    break
                self._new_blocks_ok(out)
                was_prefill = req.num_computed_tokens + num_new < req.num_tokens or num_new > 1
                req.num_computed_tokens += num_new
                if req.num_computed_tokens == req.num_tokens:
                    req.append_output_token_ids([token])
                event("step prefill" if was_prefill else "step decode")
            check_invariants(self.mgr, self.requests)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(self.running), label="finishing")
        req = self.requests.pop(rid)
        self.mgr.free(req)
        self.running.remove(rid)
        assert self.mgr.get_block_ids(rid) == [[] for _ in self.mgr.coordinator.single_type_managers]

    @precondition(lambda self: self.running)
    @rule()
    def preempt_newest(self):
        """Recompute preemption: free everything, requeue with the tokens so far."""
        rid = self.running.pop()
        req = self.requests[rid]
        self.mgr.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.append(rid)

    @rule(go=st.integers(0, 3))
    def reset_prefix_cache(self, go):
        if go:  # resets are rare in practice; most draws of this rule do nothing
            return
        in_use = self.mgr.get_num_free_blocks() < self.n - 1
        ok = self.mgr.reset_prefix_cache()
        event(f"reset {'done' if ok else 'refused'}")
        assert ok == (not in_use)
        if ok:
            assert all(b.block_hash is None for b in self.mgr.block_pool.blocks)
            assert len(self.mgr.block_pool.cached_block_hash_to_block) == 0

    @precondition(lambda self: self.mgr is not None)
    @rule(data=st.data())
    def evict_blocks(self, data):
        block_ids = data.draw(st.lists(st.integers(1, self.n - 1), max_size=4), label="evict")
        refs = [b.ref_cnt for b in self.mgr.block_pool.blocks]
        self.mgr.block_pool.evict_blocks(block_ids)
        assert all(self.mgr.block_pool.blocks[i].block_hash is None for i in block_ids)
        assert [b.ref_cnt for b in self.mgr.block_pool.blocks] == refs

    # ------------------------------------------------------------------ invariants

    @invariant()
    def ledger_invariants(self):
        if self.mgr is None:
            return
        check_invariants(self.mgr, self.requests)
        self.mirror.apply(self.mgr.take_events())
        self.mirror.check(self.mgr.block_pool)
        # Requests that hold no blocks really hold none; running ones cover their computed tokens.
        for rid in self.waiting:
            assert all(not g for g in self.mgr.get_blocks(rid).blocks)
        for rid in self.running:
            req = self.requests[rid]
            for group in self.mgr.get_blocks(rid).blocks:
                assert len(group) >= cdiv(req.num_computed_tokens, self.block_size)
            if any(b.is_null for g in self.mgr.get_blocks(rid).blocks for b in g):
                event("sliding window dropped blocks")
            # Full attention never holds the null block.
            assert all(not b.is_null for b in self.mgr.get_blocks(rid).blocks[0])

    def teardown(self):
        if self.mgr is None:
            return
        for rid in list(self.running):
            self.mgr.free(self.requests[rid])
        self.running.clear()
        check_invariants(self.mgr, self.requests)
        pool = self.mgr.block_pool
        assert pool.get_num_free_blocks() == self.n - 1
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert sorted(b.block_id for b in pool.free_block_queue.get_all_free_blocks()) == list(range(1, self.n))
        for m in self.mgr.coordinator.single_type_managers:
            assert not m.req_to_blocks and not m.num_cached_block
        assert self.mgr.get_usage() == 0.0


SETTINGS = settings(
    max_examples=80,
    stateful_step_count=50,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def _machine(name, hybrid, caching):
    cls = type(name, (LedgerMachine,), {"HYBRID": hybrid, "CACHING": caching})
    case = cls.TestCase
    case.settings = SETTINGS
    return case


TestFullAttentionCaching = _machine("FullAttentionCaching", False, True)
TestFullAttentionNoCaching = _machine("FullAttentionNoCaching", False, False)
TestHybridCaching = _machine("HybridCaching", True, True)
TestHybridNoCaching = _machine("HybridNoCaching", True, False)
