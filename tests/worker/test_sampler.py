"""Sampler: greedy, top-k/top-p limits, and seeds tied to the output position."""

import numpy as np
import pytest
import torch

from protocol import SamplingParams
from protocol.sampling import GREEDY_TEMPERATURE, INT64_MAX, INT64_MIN, MAX_INT32, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE
from worker.sampler import sample as sample_step
from worker.sampler import token_logprobs
from worker.sampling_state import SamplingState


def sample(x: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
    """The sampler over one step whose row i has params[i] and has generated positions[i] tokens so far."""
    state = SamplingState(len(params), x.shape[1], [], torch.device("cpu"))
    for row, p in enumerate(params):
        state.add(row, p, [0], [])
    state.num_output[:] = positions
    return sample_step(x, state.metadata(np.arange(len(params))))


def logits(rows=4, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    x = logits()
    assert sample(x, [SamplingParams(temperature=0.0)] * 4, [0] * 4).tolist() == x.argmax(-1).tolist()


def test_top_k_1_and_tiny_top_p_reduce_to_argmax():
    x = logits()
    params = [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)] * 2
    assert sample(x, params, [0] * 4).tolist() == x.argmax(-1).tolist()


def test_top_k_keeps_samples_inside_the_k_best():
    x = logits(rows=1, vocab=50).expand(400, 50)
    best = set(x[0].topk(3).indices.tolist())
    got = sample(x, [SamplingParams(temperature=5.0, top_k=3)] * 400, list(range(400)))
    assert set(got.tolist()) <= best and len(set(got.tolist())) > 1


def test_same_seed_and_position_same_token_whatever_the_batch():
    x = logits(rows=1, vocab=1000)
    p = SamplingParams(temperature=1.0, seed=42)
    alone = sample(x, [p], [7])
    in_batch = sample(torch.cat([logits(rows=3, vocab=1000, seed=5), x]), [SamplingParams()] * 3 + [p], [0, 0, 0, 7])
    assert alone.item() == in_batch[-1].item()
    draws = {sample(x, [p], [pos]).item() for pos in range(20)}
    assert len(draws) > 1  # a new position draws new noise


def test_mixed_batch_keeps_greedy_rows_greedy():
    x = logits()
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, seed=1)] * 2
    got = sample(x, params, [0] * 4)
    assert got[0] == x[0].argmax() and got[2] == x[2].argmax()


def test_every_bound_of_the_sampling_params_is_one_the_sampler_holds():
    """The largest top_k, the extreme temperatures and seeds give real tokens (no overflow, no NaN)."""
    x = logits(rows=6, vocab=50)
    params = [
        SamplingParams(top_k=MAX_INT32, seed=0),  # above the vocabulary: top-k is off
        SamplingParams(temperature=MAX_TEMPERATURE, seed=INT64_MAX),
        SamplingParams(temperature=GREEDY_TEMPERATURE, seed=INT64_MIN),
        SamplingParams(temperature=1e-300),  # 0 in a float32 tensor: sampled greedily instead
        SamplingParams(max_tokens=MAX_INT32, stop_token_ids=[MAX_INT32] * MAX_STOP_TOKEN_IDS, top_p=5e-324),
        SamplingParams(top_k=MAX_INT32, top_p=0.5, seed=-1),
    ]
    got = sample(x, params, [MAX_INT32] * 6).tolist()
    assert all(0 <= t < 50 for t in got)
    assert got[2:5] == x[2:5].argmax(-1).tolist()
    assert got == sample(x, params, [MAX_INT32] * 6).tolist()  # every row is seeded or greedy


def test_top_k_above_the_vocabulary_is_top_k_off():
    x = logits(rows=1, vocab=50)
    seeded = [SamplingParams(seed=s) for s in range(30)]
    off = sample(x.expand(30, 50), seeded, [0] * 30)
    huge = sample(x.expand(30, 50), [SamplingParams(seed=s, top_k=MAX_INT32) for s in range(30)], [0] * 30)
    assert off.tolist() == huge.tolist()


def test_token_logprobs_for_the_rows_that_ask():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=g)
    chosen = torch.tensor([7, 0, 49])
    got = token_logprobs(logits, chosen, [2, None, 0])
    expected = torch.log_softmax(logits, dim=-1)
    assert got[1] is None
    assert got[0].logprob == pytest.approx(float(expected[0, 7]), abs=1e-6)
    assert got[0].top_token_ids == expected[0].topk(2).indices.tolist()
    assert got[0].top_logprobs == pytest.approx(expected[0].topk(2).values.tolist(), abs=1e-6)
    assert got[2].logprob == pytest.approx(float(expected[2, 49]), abs=1e-6) and got[2].top_token_ids == []
    assert token_logprobs(logits, chosen, [None, None, None]) == [None, None, None]
