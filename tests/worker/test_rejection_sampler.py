"""The rejection sampler: greedy drafts accepted exactly while they are the argmax; sampled outputs follow the
target distribution at every position (chi-square, fixed seeds), which a wrong acceptance or residual rule fails."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from protocol import SamplingParams
from worker.rejection_sampler import greedy_verify, rejection_sample, target_probs
from worker.sampling_state import SamplingState

VOCAB = 6


def _meta(*params: SamplingParams):
    state = SamplingState(len(params), VOCAB, [], torch.device("cpu"))
    for row, p in enumerate(params):
        state.add(row, p, [1], [])
    return state.metadata(np.arange(len(params)))


def test_greedy_accepts_while_drafts_are_the_argmax():
    argmaxes = [[2, 3, 4, 5], [1, 1], [0]]  # per request: the argmax after each of its drafts, then the bonus row
    drafts = [[2, 3, 0], [4], []]
    logits = torch.full((7, VOCAB), -1.0)
    for row, token in enumerate(t for a in argmaxes for t in a):
        logits[row, token] = 3.0
    greedy = SamplingParams(temperature=0.0)
    probs = target_probs(logits, _meta(greedy, greedy, greedy), [4, 2, 1])
    assert rejection_sample(probs, drafts) == [[2, 3, 4], [1], [0]]  # a mismatch gives the argmax; no draft: argmax
    all_right = [[2, 3, 4], [1], []]
    assert rejection_sample(probs, all_right) == [[2, 3, 4, 5], [1, 1], [0]]  # all accepted: the bonus token too
    argmax = [t for a in argmaxes for t in a]  # the all-greedy fast path decides alike from the argmaxes alone
    assert greedy_verify(argmax, drafts) == [[2, 3, 4], [1], [0]]
    assert greedy_verify(argmax, all_right) == [[2, 3, 4, 5], [1, 1], [0]]


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """The distribution plain decoding samples from, computed here step by step (vLLM's order)."""
    p = torch.softmax(logits.double() / temperature, -1).numpy()
    p = np.where(p < min_p * p.max(), 0.0, p)
    order = np.argsort(-p, kind="stable")
    keep = np.zeros(VOCAB, bool)
    q = p[order] / p.sum()
    keep[order[:top_k]] = (np.cumsum(q) - q)[:top_k] <= top_p
    p = np.where(keep, p, 0.0)
    return p / p.sum()


@pytest.mark.parametrize("draft", [0, 2, 5])
def test_sampled_tokens_follow_the_target_distribution(draft):
    """Two drafts per request: the first token, and the second where the first was accepted, are distributed as
    the target's rows 0 and 1, whatever the drafts (likely, unlikely, or barred by top-k); the first draft is
    accepted at the rate p0(draft)."""
    n = 20000
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5], [0.1, 1.2, -0.4, 1.0, 0.0, 0.7], [0.0] * VOCAB])
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, min_p=0.05)
    probs = target_probs(logits.repeat(n, 1), _meta(*[params] * n), [3] * n)
    p0 = _expected(logits[0], 0.8, 5, 0.95, 0.05)
    p1 = _expected(logits[1], 0.8, 5, 0.95, 0.05)
    assert np.allclose(probs[0].double().numpy(), p0, atol=1e-6)
    out = rejection_sample(probs, [[draft, 1]] * n, torch.Generator().manual_seed(draft))
    first = np.bincount([o[0] for o in out], minlength=VOCAB)
    second = np.bincount([o[1] for o in out if o[0] == draft], minlength=VOCAB)
    checks = [(first, p0), (second, p1)] if p0[draft] else [(first, p0)]  # draft 5 is outside top-k: never accepted
    for counts, p in checks:
        support = p > 0
        assert counts[~support].sum() == 0
        assert chisquare(counts[support], counts.sum() * p[support]).pvalue > 1e-3
    accepted = sum(len(o) > 1 for o in out)
    assert abs(accepted / n - p0[draft]) < 4 * np.sqrt(p0[draft] * (1 - p0[draft]) / n) + 1e-9
