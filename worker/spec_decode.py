"""Rank 0's decisions in a step that verifies n-gram drafts: the tokens of every sampling request of the batch."""

from typing import TYPE_CHECKING

import numpy as np
import torch

from protocol import TokenLogprobs
from worker.grammar_bitmask import GrammarSource
from worker.rejection_sampler import greedy_verify, rejection_sample, target_probs

if TYPE_CHECKING:
    from worker.model_runner import ModelRunner


def verify_drafts(runner: "ModelRunner", logits: torch.Tensor, samplers: list[int], drafts: list[list[int]],
                  batch: list[tuple[str, int]], grammar: GrammarSource | None,
                  tokens: torch.Tensor) -> list[TokenLogprobs | None] | None:
    """logits: each sampler's 1 + len(drafts) rows in order. Writes sampler j's tokens into tokens[j] (the rest
    stays -1); returns the log-probabilities of the requests without drafts that asked for them (None: none did)."""
    assert runner.sampling is not None
    offsets = np.cumsum([0] + [len(d) + 1 for d in drafts])
    plain = [j for j, d in enumerate(drafts) if not d]
    spec = [j for j, d in enumerate(drafts) if d]
    logprobs = None
    if plain:
        token_ids, logprobs = runner._sample_logits(logits[offsets[plain].tolist()], [samplers[j] for j in plain],
                                                    batch, grammar)
        tokens[plain, 0] = token_ids
    if spec:
        rows = runner.kv.buffers.rows.np[: len(batch)][[samplers[j] for j in spec]]  # their sampling state rows
        spec_drafts = [drafts[j] for j in spec]
        picked = logits[[r for j in spec for r in range(offsets[j], offsets[j + 1])]]
        meta = runner.sampling.metadata(rows)
        if meta.all_greedy:
            outs = greedy_verify(picked.argmax(dim=-1).tolist(), spec_drafts)
        else:
            outs = rejection_sample(target_probs(picked, meta, [len(d) + 1 for d in spec_drafts]), spec_drafts)
        width = tokens.shape[1]
        tokens[spec] = torch.tensor([out + [-1] * (width - len(out)) for out in outs], device=tokens.device)
        runner.sampling.record_drafted(rows, np.array([len(out) for out in outs]))
    return logprobs
