"""Token sampling: greedy, temperature, top-k, top-p, and per-request seeds.

A seeded request draws its noise from a generator seeded by (seed, output position), so the same
seed gives the same tokens, also when a preempted request recomputes and samples again.
"""

import torch

from protocol import SamplingParams, TokenLogprobs


def _seed_at(seed: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (top_k 0 = off, top_p 1 = off)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((mass_before > top_p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample(logits: torch.Tensor, params: list[SamplingParams], output_positions: list[int]) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab]; output_positions[i] = outputs row i already has."""
    logits = logits.float()
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    result = logits.argmax(dim=-1)
    if bool(greedy.all()):
        return result
    dev = logits.device
    temp = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
    top_k = torch.tensor([p.top_k for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    scaled = logits / temp.unsqueeze(1)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for i, p in enumerate(params):
        if p.seed is not None and not p.greedy:
            g = torch.Generator(device=dev).manual_seed(_seed_at(p.seed, output_positions[i]))
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(greedy, result, sampled)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row with top[i] set: the log-probability of token_ids[i] under the raw logits, and the top[i] most
    likely tokens (as vLLM reports them by default: before temperature, top-k and top-p)."""
    rows = [i for i, k in enumerate(top) if k is not None]
    if not rows:
        return [None] * len(top)
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[rows].unsqueeze(1)).squeeze(1).tolist()
    best, best_ids = logprobs.topk(max(top[i] or 0 for i in rows), dim=-1)
    out: list[TokenLogprobs | None] = [None] * len(top)
    for j, i in enumerate(rows):
        k = top[i] or 0
        out[i] = TokenLogprobs(chosen[j], best_ids[j, :k].tolist(), best[j, :k].tolist())
    return out
