"""Prompt log-probabilities (vLLM's prompt_logprobs): computed from the hidden states of each prefill chunk.

The hidden state at prompt position p gives the distribution of token p + 1, so a chunk over positions
[c, c + n) yields the log-probabilities of prompt tokens c + 1 .. c + n (the last prompt position's
distribution is the first output's, sampled as usual). They are gathered across chunks and handed over with
the request's first sampled token. The engine core never gives such a request a prefix-cache hit (as vLLM:
a cached prefix has no hidden states to take them from), and a request that resumes after a preemption with
outputs already delivered has had its prompt's; only one that has generated nothing yet gathers them.
"""

from collections.abc import Callable

import torch

from protocol import SamplingParams, TokenLogprobs

ROWS_PER_SLICE = 256  # hidden rows turned into [rows, vocab] float32 logits at a time


class PromptLogprobs:
    def __init__(self) -> None:
        # request id -> (k most likely asked for, its prompt, the log-probabilities gathered so far)
        self.pending: dict[str, tuple[int, list[int], list[TokenLogprobs]]] = {}

    def add(self, req_id: str, params: SamplingParams, prompt: list[int], num_computed: int,
            num_outputs: int) -> None:
        self.pending.pop(req_id, None)
        if params.prompt_logprobs is None or num_outputs:
            return
        if num_computed:
            raise ValueError(f"{req_id} asks for prompt log-probabilities but starts at token {num_computed}: "
                             "its prompt must be computed from the start (no prefix-cache hit)")
        self.pending[req_id] = (params.prompt_logprobs, prompt, [])

    def remove(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def collect(self, logits_of: Callable[[torch.Tensor], torch.Tensor | None], hidden: torch.Tensor,
                batch: list[tuple[str, int]], counts: list[int]) -> None:
        """This step's chunk of each pending request of the batch ([tokens, hidden] in batch order)."""
        start = 0
        for (req_id, nc), n in zip(batch, counts, strict=True):
            entry = self.pending.get(req_id)
            if entry is not None:
                k, prompt, gathered = entry
                end = min(nc + n, len(prompt) - 1)  # positions whose next token is a prompt token
                for lo in range(nc, end, ROWS_PER_SLICE):
                    hi = min(lo + ROWS_PER_SLICE, end)
                    logits = logits_of(hidden[start + lo - nc : start + hi - nc])
                    if logits is not None:  # rank 0
                        gathered += _logprobs(logits, prompt[lo + 1 : hi + 1], k)
            start += n

    def take(self, batch: list[tuple[str, int]], sampled: list[list[int]]) -> list[list[TokenLogprobs] | None] | None:
        """Per request of the batch, the prompt log-probabilities of those whose first token was just sampled."""
        if not self.pending:
            return None
        out: list[list[TokenLogprobs] | None] = [None] * len(batch)
        for i, ((req_id, _), tokens) in enumerate(zip(batch, sampled, strict=True)):
            if tokens and req_id in self.pending:
                out[i] = self.pending.pop(req_id)[2]
        return out if any(x is not None for x in out) else None


def _logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprobs]:
    """Each target's log-probability and rank (1 + the tokens more likely), and the k most likely tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logprobs.device).unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    best, best_ids = logprobs.topk(k, dim=-1)
    return [TokenLogprobs(c, i, b, r) for c, i, b, r in zip(chosen.squeeze(1).tolist(), best_ids.tolist(),
                                                           best.tolist(), ranks, strict=True)]
