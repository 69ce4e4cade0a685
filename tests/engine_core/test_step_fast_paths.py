"""The step's fast paths give what the token-by-token rules give.

Sampled tokens are appended in one call and block hashes are made only once a block fills; these
tests hold both against the plain rules: a request's hashes are those of all its tokens hashed from
scratch, and a request finishes at the first token that stops it or reaches its length limit. A
runner's answer in schedule order is read row by row; any other answer is looked up by request id.
"""

import random

import pytest

from engine_core.kv_cache.hashing import get_hash_fn, get_request_block_hasher
from engine_core.request import Request
from engine_core.scheduler import Scheduler
from protocol import KVCacheConfig, KVCacheGroupSpec, ModelRunnerOutput, TokenLogprobs
from protocol.config import engine_config
from tests.engine_core.scheduler_support import SPEC, VOCAB, make_request, prompt_of


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("hash_name", ["sha256", "xxhash"])
@pytest.mark.parametrize("cache_salt", [None, "tenant"])
def test_block_hashes_do_not_depend_on_how_tokens_arrive(block_size, hash_name, cache_salt):
    rng = random.Random(block_size * 31 + len(hash_name))
    hasher = get_request_block_hasher(block_size, get_hash_fn(hash_name))
    for trial in range(20):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 70))]
        request = Request(f"r{trial}", prompt, cache_salt=cache_salt, block_hasher=hasher)
        for _ in range(rng.randrange(1, 12)):
            request.append_output_token_ids([rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 1, 2, 5, 40]))])
            assert len(request.block_hashes) == request.num_tokens // block_size
        fresh = Request("fresh", list(request.all_token_ids), cache_salt=cache_salt, block_hasher=hasher)
        assert request.block_hashes == fresh.block_hashes


def _expected_cut(tokens, request, eos, max_model_len):
    """The per-token rule: after each token, a stop or eos token stops; then the length limits cap."""
    params = request.sampling_params
    for n, token in enumerate(tokens, 1):
        if token in params.stop_token_ids or (not params.ignore_eos and token in eos):
            return n, "stop"
        if request.num_output_tokens + n >= params.max_tokens or request.num_tokens + n >= max_model_len:
            return n, "length"
    return len(tokens), None


@pytest.mark.parametrize("seed", range(6))
def test_several_sampled_tokens_finish_where_the_per_token_rule_does(seed):
    rng = random.Random(seed)
    eos, max_model_len = [3], 120
    kv = KVCacheConfig(num_blocks=400, kv_cache_groups=[KVCacheGroupSpec(["layer.0"], SPEC)])
    sched = Scheduler(engine_config(max_num_batched_tokens=4096), kv, max_model_len, eos_token_ids=eos,
                      vocab_size=VOCAB)
    hasher = get_request_block_hasher(SPEC.block_size, get_hash_fn("sha256"))
    for i in range(24):
        prompt = prompt_of(seed * 100 + i, rng.randrange(1, 100))
        req = make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 40), stop_token_ids=rng.choice([[], [5], [5, 8]]),
                           ignore_eos=rng.random() < 0.3)
        assert sched.add_request(req) is None
    tokens_of: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    for _ in range(500):
        if not sched.has_requests():
            break
        so = sched.schedule()
        requests = {rid: sched.requests[rid] for rid in so.num_scheduled_tokens}
        ids, sampled, expected = [], [], {}
        for rid, request in requests.items():
            done = request.num_computed_tokens >= request.num_tokens
            tokens = [rng.choice([3, 5, 8, *range(10, 20)]) for _ in range(rng.randrange(1, 7))] if done else []
            ids.append(rid)
            sampled.append(tokens)
            if tokens:
                expected[rid] = _expected_cut(tokens, request, eos, max_model_len)
        outs = sched.update_from_output(so, ModelRunnerOutput(so.step, ids, sampled))
        assert [o.request_id for o in outs] == list(expected)
        for out, tokens in zip(outs, (t for t in sampled if t), strict=True):
            n, reason = expected[out.request_id]
            assert out.new_token_ids == tokens[:n] and out.finish_reason == reason
            tokens_of.setdefault(out.request_id, []).extend(out.new_token_ids)
            request = requests[out.request_id]
            assert request.output_token_ids == tokens_of[out.request_id]
            fresh = Request("fresh", list(request.all_token_ids), block_hasher=hasher)
            assert request.block_hashes == fresh.block_hashes
            if reason is not None:
                finished[out.request_id] = reason
    assert not sched.has_requests() and len(finished) == 24
    assert set(finished.values()) == {"stop", "length"}
    assert sched.num_generation_tokens == sum(len(t) for t in tokens_of.values())


def _decoding_scheduler(num_requests: int) -> Scheduler:
    kv = KVCacheConfig(num_blocks=200, kv_cache_groups=[KVCacheGroupSpec(["layer.0"], SPEC)])
    sched = Scheduler(engine_config(max_num_batched_tokens=4096), kv, 512, vocab_size=VOCAB)
    for i in range(num_requests):
        assert sched.add_request(make_request(f"r{i}", prompt_of(i, 20 + i), max_tokens=50)) is None
    return sched


def _runner_output(step: int, rows, with_logprobs: bool) -> ModelRunnerOutput:
    return ModelRunnerOutput(step, [r[0] for r in rows], [r[1] for r in rows],
                             [r[2] for r in rows] if with_logprobs else None)


@pytest.mark.parametrize("answer", ["reversed", "rows missing", "duplicate row"])
@pytest.mark.parametrize("with_logprobs", [False, True])
def test_runner_answer_out_of_schedule_order_gives_the_same_outputs(answer, with_logprobs):
    in_order, other = _decoding_scheduler(6), _decoding_scheduler(6)
    for step in range(4):
        so = in_order.schedule()
        assert other.schedule() == so
        rows = [(rid, [10 + step + i], TokenLogprobs(-0.5 * i)) for i, rid in enumerate(so.num_scheduled_tokens)]
        if answer == "rows missing":
            rows = rows[::2]  # the others sampled nothing this step
        expected = in_order.update_from_output(so, _runner_output(so.step, rows, with_logprobs))
        assert len(expected) == len(rows) and all((o.logprobs is not None) == with_logprobs for o in expected)
        shuffled = {"reversed": rows[::-1], "rows missing": rows[::-1], "duplicate row": [*rows, rows[0]]}[answer]
        assert other.update_from_output(so, _runner_output(so.step, shuffled, with_logprobs)) == expected
        assert [r.all_token_ids for r in other.running] == [r.all_token_ids for r in in_order.running]
