"""Verifying n-gram drafts: each request's tokens from the target model's logits at its draft positions.

A request with drafts d_1..d_k has k + 1 rows of logits: row j is the target distribution p_j of the token after
d_1..d_j (row 0: after its last sampled token). p_j is the distribution plain decoding samples from (temperature,
min-p, top-k, top-p, as worker/sampler.py applies them), so the output has exactly the target's distribution:

- greedy: d_j is accepted while it is the argmax of p_{j-1}; the first mismatch is replaced by that argmax.
- random: an n-gram draft is a point mass, so d_j is accepted with probability p_{j-1}(d_j); on rejection the token
  is drawn from p_{j-1} with d_j's mass removed and renormalised (the residual max(p - q, 0) of rejection sampling).

After k acceptances the bonus token is drawn from p_k. Every request gets its accepted drafts and one more token.
Requests with logits processors, seeds or logprobs never draft (engine_core/spec_decode/drafting.py).
"""

import torch

from worker.sampler import apply_min_p, apply_top_k_top_p
from worker.sampling_state import SamplingMetadata


def target_probs(logits: torch.Tensor, meta: SamplingMetadata, counts: list[int]) -> torch.Tensor:
    """Per row, the distribution plain decoding would sample from; greedy requests' rows are one-hot argmaxes.
    counts: each request's rows (its meta row applies to all of them)."""
    x = logits.float()
    greedy_rows = torch.repeat_interleave(meta.greedy, torch.tensor(counts, device=x.device))
    one_hot = torch.zeros_like(x).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
    if meta.all_greedy:
        return one_hot
    assert meta.temperature is not None

    def per_row(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else torch.repeat_interleave(values, torch.tensor(counts, device=x.device))

    temperature = per_row(meta.temperature)
    assert temperature is not None
    x = x / temperature.unsqueeze(1)
    min_p = per_row(meta.min_p)
    if min_p is not None:
        x = apply_min_p(x, min_p)
    top_k, top_p = per_row(meta.top_k), per_row(meta.top_p)
    if top_k is not None or top_p is not None:
        x = apply_top_k_top_p(x, top_k, top_p)
    return torch.where(greedy_rows.unsqueeze(1), one_hot, x.softmax(dim=-1))


def greedy_verify(argmax: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """rejection_sample for all-greedy requests, from each row's argmax alone (no distributions needed)."""
    out, start = [], 0
    for d in drafts:
        n = 0
        while n < len(d) and d[n] == argmax[start + n]:
            n += 1
        out.append([*d[:n], argmax[start + n]])
        start += len(d) + 1
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs (the exponential race worker/sampler.py uses; a one-hot row gives its token)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def rejection_sample(probs: torch.Tensor, drafts: list[list[int]],
                     generator: torch.Generator | None = None) -> list[list[int]]:
    """Each request's accepted drafts and one more token; probs: its 1 + len(drafts) rows, requests in order."""
    counts = [len(d) + 1 for d in drafts]
    starts = torch.tensor([0, *counts], device=probs.device).cumsum(0)[:-1].tolist()
    draft_rows = [s + j for s, d in zip(starts, drafts, strict=True) for j in range(len(d))]
    flat = [t for d in drafts for t in d]
    p_draft = probs[draft_rows, flat].tolist() if flat else []
    uniform = torch.rand(len(flat), generator=generator, device=probs.device).tolist()
    out, final_rows, k = [], [], 0
    for start, d in zip(starts, drafts, strict=True):
        n = 0
        while n < len(d) and uniform[k + n] < p_draft[k + n]:  # a one-hot row accepts exactly its token
            n += 1
        out.append(d[:n])
        final_rows.append(start + n)
        k += len(d)
    last = probs[final_rows].clone()
    for i, d in enumerate(drafts):
        if len(out[i]) < len(d):  # rejected: the residual, the rejected draft's mass removed
            last[i, d[len(out[i])]] = 0.0
    sums = last.sum(dim=-1, keepdim=True)
    last = torch.where(sums > 0, last / sums, probs[final_rows])  # no mass left besides the draft: rounding only
    for tokens, t in zip(out, draw(last, generator).tolist(), strict=True):
        tokens.append(t)
    return out
