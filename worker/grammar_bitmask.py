"""The engine core's grammar bitmask (GrammarOutput) applied to the logits of a step's constrained sampling rows
before anything else samples from them: a token the row's grammar does not allow gets -inf, so neither sampling
nor the log-probabilities can pick it (as in vLLM, the log-probabilities are those of the masked logits)."""

from collections.abc import Callable

import numpy as np
import torch

from protocol import GrammarOutput

GrammarSource = Callable[[], GrammarOutput]  # the step's bitmask; in a worker process it may still be on its way


def constrain(logits: torch.Tensor, structured: np.ndarray, req_ids: list[str], grammar: GrammarSource | None) -> None:
    """logits [rows, vocab] of the sampling rows req_ids (structured: which of them have a grammar): wait for the
    step's bitmask if any row needs it, check that its rows are exactly those, and apply it in place."""
    positions = np.flatnonzero(structured)
    if not positions.size:
        return
    expected = [req_ids[i] for i in positions]
    if grammar is None:
        raise RuntimeError(f"{expected} sample with a grammar, but no bitmask comes with the step")
    bitmask = grammar()  # its source checks that it is this step's
    if bitmask.structured_output_request_ids != expected:
        raise RuntimeError(f"step {bitmask.step}: the bitmask has rows {bitmask.structured_output_request_ids}, "
                           f"the step's constrained sampling requests are {expected}")
    apply_grammar_bitmask(logits, positions, bitmask.grammar_bitmask)


def apply_grammar_bitmask(logits: torch.Tensor, positions: np.ndarray, bitmask: bytes) -> None:
    """Row i of bitmask (little-endian int32 words, bit t % 32 of word t // 32 for token t) masks logits[positions[i]]."""
    vocab = logits.shape[1]
    words = np.frombuffer(bitmask, dtype="<i4").reshape(len(positions), -1)
    if words.shape[1] * 32 < vocab:
        raise ValueError(f"a bitmask of {words.shape[1] * 32} tokens for a vocabulary of {vocab}")
    allowed = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    banned = torch.from_numpy(allowed == 0).to(logits.device)
    index = torch.from_numpy(positions).to(logits.device)
    logits[index] = logits[index].masked_fill(banned, float("-inf"))
