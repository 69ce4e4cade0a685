"""apply_top_k_top_p sorts only the k largest where it can: the same logits as a full sort's masking."""

import pytest
import torch

from worker.sampler import apply_top_k_top_p


def full_sort_reference(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_logits, order = x.sort(dim=-1, descending=True)
    vocab = x.shape[-1]
    ranks = torch.arange(vocab).unsqueeze(0)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill((mass_before > top_p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    return torch.empty_like(x).scatter_(1, order, sorted_logits)


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
@pytest.mark.parametrize(("ks", "ps"), [
    ([1, 5, 50, 3], None),  # top-k alone: the k-th value as a threshold
    ([1, 5, 50, 0], None),  # a row without top-k is left as it is
    ([2, 40, 7, 3], [0.9, 0.5, 1.0, 0.1]),  # top-k and top-p: the k largest sorted only
    ([2, 0, 7, 3], [0.9, 0.5, 1.0, 0.1]),  # a row without top-k: the full sort
    (None, [0.9, 0.5, 1.0, 1e-6]),
    ([10**9, 10**9, 3, 1], None),  # above the vocabulary: off
])
def test_equal_to_masking_after_a_full_sort(vocab, ks, ps):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(4, vocab, generator=g) * 3  # distinct values: no ties at the k-th
    top_k = None if ks is None else torch.tensor(ks)
    top_p = None if ps is None else torch.tensor(ps)
    assert torch.equal(apply_top_k_top_p(x, top_k, top_p), full_sort_reference(x, top_k, top_p))


def test_top_k_alone_keeps_ties_at_the_kth_value():
    x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p(x, torch.tensor([2]), None)
    assert out.tolist() == [[3.0, float("-inf"), 2.0, 2.0, float("-inf")]]
