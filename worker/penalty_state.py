"""What the repetition, frequency and presence penalties need of each penalised request: the distinct tokens of its
prompt and outputs, and how often each was generated, kept sparse so that a step touches only those tokens.

Per block table row: `seen_ids[row, :n]` are the row's n distinct tokens and `output_counts[row, :n]` their output
counts; `slot_of[row, token]` is the token's place in that list (-1: not seen), so a sampled token is counted with
one lookup. A step gathers the rows' lists (padded with each row's first token, which rewrites the same value) and
penalises those logits only: its cost follows the tokens seen, not the vocabulary.
"""

from dataclasses import dataclass

import numpy as np
import torch

MIN_WIDTH = 256  # the lists' first width; it doubles when a row outgrows it


@dataclass
class SeenTokens:
    """The penalised rows of one step: their distinct tokens and output counts, [P, width], padded."""

    token_ids: torch.Tensor
    output_counts: torch.Tensor


class PenaltyState:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self.slot_of = torch.full((max_num_reqs, vocab_size), -1, dtype=torch.int32, device=device)
        self.seen_ids = torch.zeros(max_num_reqs, MIN_WIDTH, dtype=torch.long, device=device)
        self.output_counts = torch.zeros(max_num_reqs, MIN_WIDTH, device=device)
        self.num_seen = np.zeros(max_num_reqs, np.int64)

    def add(self, row: int, prompt: list[int], outputs: list[int]) -> None:
        self.remove(row)
        seen = torch.tensor(sorted({*prompt, *outputs}), dtype=torch.long, device=self.device)
        n = len(seen)
        self._fit(n)
        self.seen_ids[row, :n] = seen
        counts = self.output_counts[row]
        counts.zero_()
        if outputs:
            out = torch.tensor(outputs, dtype=torch.long, device=self.device)
            counts.index_add_(0, torch.searchsorted(seen, out), torch.ones(len(outputs), device=self.device))
        self.slot_of[row, seen] = torch.arange(n, dtype=torch.int32, device=self.device)
        self.num_seen[row] = n

    def remove(self, row: int) -> None:
        n = int(self.num_seen[row])
        if n:
            self.slot_of[row, self.seen_ids[row, :n]] = -1
            self.num_seen[row] = 0

    def record(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """Count one sampled token per row (distinct rows); a token new to its row joins the row's list."""
        r = torch.from_numpy(rows).to(self.device)
        slots = self.slot_of[r, token_ids].long()
        slots_np = slots.cpu().numpy()
        new = np.flatnonzero(slots_np < 0)
        if new.size:
            new_rows = rows[new]
            places = self.num_seen[new_rows]
            self.num_seen[new_rows] += 1
            self._fit(int(self.num_seen[new_rows].max()))
            p, nr, tokens = (torch.from_numpy(a).to(self.device) for a in (places, new_rows, new))
            tokens = token_ids[tokens]
            self.slot_of[nr, tokens] = p.to(torch.int32)
            self.seen_ids[nr, p] = tokens
            slots[torch.from_numpy(new).to(self.device)] = p
        self.output_counts.index_put_((r, slots), torch.ones(len(rows), device=self.device), accumulate=True)

    def gather(self, rows: np.ndarray) -> SeenTokens:
        """The rows' lists at the width of the longest, each padded with its first entry."""
        lengths = self.num_seen[rows]
        width = int(lengths.max())
        r = torch.from_numpy(rows).to(self.device)
        ids, counts = self.seen_ids[r, :width], self.output_counts[r, :width]
        pad = torch.arange(width, device=self.device) >= torch.from_numpy(lengths).to(self.device).unsqueeze(1)
        return SeenTokens(torch.where(pad, ids[:, :1], ids), torch.where(pad, counts[:, :1], counts))

    def _fit(self, n: int) -> None:
        width = self.seen_ids.shape[1]
        if n <= width:
            return
        while width < n:
            width *= 2
        grow = width - self.seen_ids.shape[1]
        self.seen_ids = torch.nn.functional.pad(self.seen_ids, (0, grow))
        self.output_counts = torch.nn.functional.pad(self.output_counts, (0, grow))
