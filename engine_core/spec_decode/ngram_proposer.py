"""The n-gram proposer (vLLM's prompt lookup): drafts from the request's own tokens, with no model.

It lives in the engine core, which holds every request's prompt and output tokens and decides each step's
tokens: a draft must be known when the step is scheduled, because its tokens take budget and KV slots there.
The worker knows a sampled token first, which would matter if a request's next step were scheduled while its
current one runs (async scheduling); a drafting request is instead scheduled once its step is back (see
engine_core/spec_decode/drafting.py), so the engine core always has the tokens the proposer reads.
"""

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            # windows starting at 0 .. n_tokens - n - 1: every occurrence but the suffix itself
            windows = sliding_window_view(tokens[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == tokens[n_tokens - n :]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return token_ids[start : start + k]
        return []
