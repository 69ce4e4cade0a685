"""Token sampling in vLLM's order, batched over the step's sampling rows (worker/sampling_state.py gathers them).

1. logit_bias, allowed_token_ids and one-token bad words (one additive row per request), then the ids barred
   this step (min_tokens not reached, a bad word's prefix just generated), then the repetition penalty (prompt
   and output tokens) and the frequency and presence penalties (output tokens). Greedy rows take the argmax here.
2. Temperature, min_p, top-k and top-p, then a draw; a seeded request draws its noise from a generator seeded by
   (seed, output position), so the same seed gives the same tokens, also when a preempted request recomputes.

Log-probabilities are those of the raw logits (before any of this), as vLLM reports them by default.
"""

import torch

from protocol import TokenLogprobs
from worker.sampling_state import Penalties, SamplingMetadata


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """One token per row of `logits` [rows, vocab]; the logits themselves are left as they are."""
    x = logits.float()
    if meta.processes_logits:
        x = apply_logits_processors(x.clone() if x is logits else x, meta)
    greedy = x.argmax(dim=-1)
    if meta.all_greedy:
        return greedy
    assert meta.temperature is not None
    x = x / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        x = apply_min_p(x, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        x = apply_top_k_top_p(x, meta.top_k, meta.top_p)
    probs = x.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for i, seed in meta.seeds:
        noise[i].exponential_(generator=torch.Generator(device=probs.device).manual_seed(seed))
    return torch.where(meta.greedy, greedy, (probs / noise).argmax(dim=-1))


def apply_logits_processors(x: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Bias, bans and penalties, in place on float32 logits."""
    if meta.additive is not None:
        positions, rows, table = meta.additive
        x.index_add_(0, positions, table.index_select(0, rows))
    if meta.banned is not None:
        x.index_put_(meta.banned, torch.tensor(float("-inf"), device=x.device))
    if meta.penalties is not None:
        apply_penalties(x, meta.penalties)
    return x


def apply_penalties(x: torch.Tensor, p: Penalties) -> None:
    """vLLM's penalties, on the logits of the tokens each row has seen only: the repetition penalty divides a
    positive logit and multiplies a negative one of every token in the prompt or the outputs; then frequency x
    count and presence x (count > 0) are subtracted (counts of outputs only). A row's padding repeats one of its
    tokens, so its writes agree."""
    flat = (p.positions.unsqueeze(1) * x.shape[1] + p.seen.token_ids).view(-1)
    logits = x.view(-1).index_select(0, flat).view(p.seen.token_ids.shape)
    logits = torch.where(logits > 0, logits / p.repetition, logits * p.repetition)
    counts = p.seen.output_counts
    logits -= counts * p.frequency + (counts > 0).to(logits.dtype) * p.presence
    x.view(-1).index_copy_(0, flat, logits.view(-1))


def apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's most likely token's (min_p 0 drops none)."""
    probs = x.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return x.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set logits outside each row's top-k and top-p nucleus to -inf (top_k 0 = off, top_p 1 = off). Only the
    largest k of the rows are sorted where every row has a top-k (a full sort of a 128k vocabulary costs more than
    the model's step at small batches); top-k alone keeps the logits at least the k-th largest, ties too, as vLLM."""
    vocab = x.shape[-1]
    k = None if top_k is None else torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    if k is not None and top_p is None:
        return apply_top_k_only(x, k)
    width = vocab if k is None else int(k.max())
    sorted_logits, order = x.topk(width, dim=-1) if width < vocab else x.sort(dim=-1, descending=True)
    ranks = torch.arange(width, device=x.device).unsqueeze(0)
    if k is not None:
        sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill((mass_before > top_p.unsqueeze(1)) & (ranks > 0), float("-inf"))
    out = torch.empty_like(x) if width == vocab else torch.full_like(x, float("-inf"))
    return out.scatter_(1, order, sorted_logits)


def apply_top_k_only(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Logits below each row's k-th largest set to -inf (k = vocab: the row is left as it is)."""
    vocab = x.shape[-1]
    on = k < vocab
    if not bool(on.any()):
        return x
    width = int(k[on].max())
    kth = x.topk(width, dim=-1).values.gather(1, (k.clamp(max=width) - 1).unsqueeze(1))
    return x.masked_fill((x < kth) & on.unsqueeze(1), float("-inf"))


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row with top[i] set: the log-probability of token_ids[i] under the raw logits, and the top[i] most
    likely tokens (as vLLM reports them by default: before penalties, temperature, top-k and top-p)."""
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
