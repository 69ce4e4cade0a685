"""The n-gram proposer (vLLM's prompt lookup): drafts from the request's own tokens, with no model.

It lives in the engine core, which holds every request's prompt and output tokens and decides each step's
tokens: a draft must be known when the step is scheduled, because its tokens take budget and KV slots there.
The worker knows a sampled token first, which would matter if a request's next step were scheduled while its
current one runs (async scheduling); a drafting request is instead scheduled once its step is back (see
engine_core/spec_decode/drafting.py), so the engine core always has the tokens the proposer reads.
"""

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k, self.min_n, self.max_n = num_speculative_tokens, prompt_lookup_min, prompt_lookup_max

    def propose(self, token_ids: list[int], max_drafts: int) -> list[int]:
        """Up to min(k, max_drafts) tokens: those that followed the earliest earlier occurrence of the longest
        suffix of token_ids of prompt_lookup_min..prompt_lookup_max tokens; [] when no such suffix occurred."""
        k = min(self.k, max_drafts)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # where earlier occurrences of the suffix would end
        length = np.ones(len(ends), dtype=np.int64)  # each one's common suffix with token_ids, up to max_n
        alive = np.ones(len(ends), dtype=bool)
        for j in range(1, self.max_n):
            alive &= ends >= j
            alive[alive] = tokens[ends[alive] - j] == tokens[n_tokens - 1 - j]
            length += alive
        if not ends.size or length.max() < self.min_n:
            return []
        start = int(ends[np.argmax(length)]) + 1  # argmax: the first, i.e. earliest, of the longest
        return token_ids[start : start + k]
