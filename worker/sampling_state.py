"""Each running request's sampling parameters and history, in persistent buffers indexed by its block table row.

A request's parameters are written once, when it is added (new, or resumed after a preemption with its outputs
replayed); each step `metadata` gathers the sampling rows' values with numpy/torch indexing, and `record` counts
the sampled tokens. Nothing loops over requests or the vocabulary per step, except drawing seeded noise, which
takes one generator per seeded row. What needs a [rows, vocab] tensor (logit bias and allowed ids; the token lookup
behind the penalties) is allocated the first time a request uses it, so a batch that uses none pays nothing.
"""

from dataclasses import dataclass

import numpy as np
import torch

from protocol import SamplingParams
from worker.penalty_state import PenaltyState, SeenTokens

NO_TOKEN = -1  # an empty place in a row's recent outputs (no token id matches it)


@dataclass
class Penalties:
    """The penalised sampling rows: their batch positions and penalties ([P, 1])."""

    positions: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    seen: SeenTokens  # each row's distinct prompt and output tokens, and their output counts


@dataclass
class SamplingMetadata:
    """One step's sampling rows, in batch order; None where no row of the step uses a control."""

    greedy: torch.Tensor  # bool [B]
    all_greedy: bool
    temperature: torch.Tensor | None  # [B], 1 for greedy rows; None when all are greedy
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    seeds: list[tuple[int, int]]  # (batch position, seed of this draw) of the seeded sampling rows
    additive: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # positions, rows, table [max rows, vocab]
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (positions, token ids) set to -inf: min_tokens, bad words
    penalties: Penalties | None
    logprobs: list[int | None] | None  # per row: top logprobs asked for; None when no row asked

    @property
    def processes_logits(self) -> bool:
        """Controls that change the logits before greedy sampling (the penalties apply at temperature 0 too)."""
        return self.additive is not None or self.banned is not None or self.penalties is not None


def seed_at(seed: int, position: int) -> int:
    """The seed of a request's draw at an output position: the same tokens after a preemption recomputes."""
    return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) % (1 << 63)


class SamplingState:
    def __init__(self, max_num_reqs: int, vocab_size: int, eos_token_ids: list[int], device: torch.device):
        n = max_num_reqs
        self.max_num_reqs, self.vocab_size, self.device = n, vocab_size, device
        self.eos_token_ids = list(eos_token_ids)
        self.greedy = np.ones(n, bool)
        self.temperature, self.top_p = np.ones(n, np.float32), np.ones(n, np.float32)
        self.top_k, self.min_p = np.zeros(n, np.int64), np.zeros(n, np.float32)
        self.seed, self.seeded = np.zeros(n, np.int64), np.zeros(n, bool)
        self.logprobs = np.full(n, -1, np.int64)
        self.repetition = np.ones(n, np.float32)
        self.frequency, self.presence = np.zeros(n, np.float32), np.zeros(n, np.float32)
        self.penalised, self.has_additive = np.zeros(n, bool), np.zeros(n, bool)
        self.num_output, self.min_tokens = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.additive: torch.Tensor | None = None
        self.penalties: PenaltyState | None = None
        self.stop_ids: dict[int, list[int]] = {}  # rows with min_tokens: the ids barred until it is reached
        self.bad_words: dict[int, list[list[int]]] = {}  # rows with bad words of two or more tokens
        self.watched = np.zeros(n, bool)  # the rows of bad_words
        self.recent = np.full((n, 1), NO_TOKEN, np.int64)  # each row's last outputs, oldest first (bad words)
        self._pairs: tuple[np.ndarray, ...] | None = None  # flattened stop_ids and bad_words, rebuilt on change
        self.in_batch, self.position_of = np.zeros(n, bool), np.zeros(n, np.int64)
        self.structured = np.zeros(n, bool)  # rows with structured outputs: their grammar's bitmask comes each step

    # ---- requests in and out ---------------------------------------------------------------

    def add(self, row: int, params: SamplingParams, prompt: list[int], outputs: list[int]) -> None:
        """A request new to the runner, or resumed with its outputs so far: every field of its row rewritten."""
        self.greedy[row] = params.greedy
        self.temperature[row] = 1.0 if params.greedy else params.temperature
        self.top_k[row], self.top_p[row], self.min_p[row] = params.top_k, params.top_p, params.min_p
        self.seeded[row] = params.seed is not None and not params.greedy
        self.seed[row] = params.seed or 0
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.num_output[row], self.min_tokens[row] = len(outputs), params.min_tokens
        self.structured[row] = params.structured_outputs is not None
        self._add_penalties(row, params, prompt, outputs)
        self._add_additive(row, params)
        self._add_sparse(row, params, outputs)

    def remove(self, row: int) -> None:
        """A finished or preempted request's row: it stops costing anything in later steps."""
        if self.penalised[row]:
            assert self.penalties is not None
            self.penalties.remove(row)
        self.penalised[row] = self.has_additive[row] = self.structured[row] = False
        self._remove_sparse(row)

    def _add_penalties(self, row: int, params: SamplingParams, prompt: list[int], outputs: list[int]) -> None:
        if self.penalised[row]:
            assert self.penalties is not None
            self.penalties.remove(row)
        self.penalised[row] = params.has_penalties
        self.repetition[row] = params.repetition_penalty
        self.frequency[row], self.presence[row] = params.frequency_penalty, params.presence_penalty
        if params.has_penalties:
            if self.penalties is None:
                self.penalties = PenaltyState(self.max_num_reqs, self.vocab_size, self.device)
            self.penalties.add(row, prompt, outputs)

    def _add_additive(self, row: int, params: SamplingParams) -> None:
        """logit_bias, allowed_token_ids and one-token bad words: one row added to the logits."""
        single = [w[0] for w in params.bad_words_token_ids if len(w) == 1]
        used = bool(params.logit_bias) or params.allowed_token_ids is not None or bool(single)
        self.has_additive[row] = used
        if not used:
            return
        if self.additive is None:
            self.additive = torch.zeros(self.max_num_reqs, self.vocab_size, device=self.device)
        add = self.additive[row]
        if params.allowed_token_ids is not None:
            add.fill_(float("-inf"))
            add[self._ids(params.allowed_token_ids)] = 0.0
        else:
            add.zero_()
        if params.logit_bias:
            add[self._ids(list(params.logit_bias))] += torch.tensor(list(params.logit_bias.values()),
                                                                    device=self.device)
        if single:
            add[self._ids(single)] = float("-inf")

    def _add_sparse(self, row: int, params: SamplingParams, outputs: list[int]) -> None:
        """min_tokens' barred ids and longer bad words: a few ids per request, kept as (row, id) pairs."""
        self._remove_sparse(row)
        if params.min_tokens > len(outputs):
            self.stop_ids[row] = sorted({*params.stop_token_ids, *self.eos_token_ids})
        words = [w for w in params.bad_words_token_ids if len(w) > 1]
        if words:
            self.bad_words[row] = words
            self.watched[row] = True
            width = max(self.recent.shape[1], max(len(w) for w in words) - 1)
            if width > self.recent.shape[1]:
                grown = np.full((self.max_num_reqs, width), NO_TOKEN, np.int64)
                grown[:, width - self.recent.shape[1]:] = self.recent
                self.recent = grown
            last = outputs[-width:]
            self.recent[row] = NO_TOKEN
            self.recent[row, width - len(last):] = last
        if row in self.stop_ids or words:
            self._pairs = None

    def _remove_sparse(self, row: int) -> None:
        had_stop_ids = self.stop_ids.pop(row, None) is not None
        self.watched[row] = False
        if self.bad_words.pop(row, None) is not None or had_stop_ids:
            self._pairs = None

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    # ---- one step ----------------------------------------------------------------------------

    def metadata(self, rows: np.ndarray) -> SamplingMetadata:
        """The sampling rows' parameters, in batch order (rows: their block table rows)."""
        greedy = self.greedy[rows]
        all_greedy = bool(greedy.all())
        top_k, top_p, min_p = self.top_k[rows], self.top_p[rows], self.min_p[rows]
        seeded = np.flatnonzero(self.seeded[rows])
        ks = self.logprobs[rows]
        return SamplingMetadata(
            greedy=self._tensor(greedy),
            all_greedy=all_greedy,
            temperature=None if all_greedy else self._tensor(self.temperature[rows]),
            top_k=None if all_greedy or not top_k.any() else self._tensor(top_k),
            top_p=None if all_greedy or bool((top_p >= 1.0).all()) else self._tensor(top_p),
            min_p=None if all_greedy or not min_p.any() else self._tensor(min_p),
            seeds=[(int(i), seed_at(int(self.seed[rows[i]]), int(self.num_output[rows[i]]))) for i in seeded],
            additive=self._additive_rows(rows),
            banned=self._banned(rows),
            penalties=self._penalties(rows),
            logprobs=None if bool((ks < 0).all()) else [k if k >= 0 else None for k in ks.tolist()],
        )

    def record(self, rows: np.ndarray, token_ids: torch.Tensor) -> None:
        """The tokens sampled for rows: output counts, penalty counts and the recent outputs bad words look at."""
        self.num_output[rows] += 1
        penalised = np.flatnonzero(self.penalised[rows])
        if penalised.size:
            assert self.penalties is not None
            self.penalties.record(rows[penalised], token_ids[self._tensor(penalised)])
        if self.bad_words:
            watched = np.flatnonzero(self.watched[rows])
            if watched.size:
                r_np = rows[watched]
                self.recent[r_np, :-1] = self.recent[r_np, 1:]
                self.recent[r_np, -1] = token_ids.cpu().numpy()[watched]

    def record_drafted(self, rows: np.ndarray, counts: np.ndarray) -> None:
        """Rows that verified drafts gave counts tokens each; they have no penalties, bad words or seeds
        (engine_core/spec_decode/drafting.py), so only their output counts move."""
        self.num_output[rows] += counts

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device)

    def _additive_rows(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        positions = np.flatnonzero(self.has_additive[rows])
        if not positions.size:
            return None
        assert self.additive is not None
        return self._tensor(positions), self._tensor(rows[positions]), self.additive

    def _penalties(self, rows: np.ndarray) -> Penalties | None:
        positions = np.flatnonzero(self.penalised[rows])
        if not positions.size:
            return None
        assert self.penalties is not None
        r = rows[positions]
        return Penalties(self._tensor(positions), self._tensor(self.repetition[r, None]),
                         self._tensor(self.frequency[r, None]), self._tensor(self.presence[r, None]),
                         self.penalties.gather(r))

    def _banned(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(positions, token ids) to bar this step: min_tokens not reached yet, bad words whose prefix was just
        generated."""
        if not self.stop_ids and not self.bad_words:
            return None
        if self._pairs is None:
            self._pairs = self._build_pairs()
        stop_row, stop_id, word_row, prefix, valid, last = self._pairs
        self.in_batch[:] = False
        self.in_batch[rows] = True
        self.position_of[rows] = np.arange(len(rows))
        waiting = self.in_batch[stop_row] & (self.num_output[stop_row] < self.min_tokens[stop_row])
        matched = self.in_batch[word_row] & ((self.recent[word_row] == prefix) | ~valid).all(axis=1)
        barred_rows = np.concatenate([stop_row[waiting], word_row[matched]])
        if not barred_rows.size:
            return None
        return self._tensor(self.position_of[barred_rows]), self._tensor(np.concatenate([stop_id[waiting],
                                                                                           last[matched]]))

    def _build_pairs(self) -> tuple[np.ndarray, ...]:
        """Flatten stop_ids and bad_words (once per change of the requests that use them, not per step)."""
        stop_row = np.array([r for r, ids in self.stop_ids.items() for _ in ids], np.int64)
        stop_id = np.array([t for ids in self.stop_ids.values() for t in ids], np.int64)
        words = [(r, w) for r, ws in self.bad_words.items() for w in ws]
        width = self.recent.shape[1]
        prefix = np.full((len(words), width), NO_TOKEN, np.int64)
        valid = np.zeros((len(words), width), bool)
        for i, (_, w) in enumerate(words):
            prefix[i, width - len(w) + 1:] = w[:-1]
            valid[i, width - len(w) + 1:] = True
        word_row = np.array([r for r, _ in words], np.int64)
        last = np.array([w[-1] for _, w in words], np.int64)
        return stop_row, stop_id, word_row, prefix, valid, last
