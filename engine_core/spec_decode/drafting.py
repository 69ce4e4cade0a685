"""The scheduler's side of speculative decoding: which requests draft, how many tokens, and what a step's answer
does to them.

A decoding request with drafts is scheduled for 1 + len(drafts) tokens (its last sampled token, then the drafts).
The ledger gives the drafts lookahead slots (allocate_slots(request, 1, num_lookahead_tokens=len(drafts))): their
blocks are allocated with the request's but never hash-registered, since the hashing stops at request.num_tokens,
which counts no draft. num_computed_tokens counts all of them once scheduled; the step's answer (the accepted
drafts and one more token) rolls it back by the rejected drafts. The blocks that held only rejected slots stay the
request's: as the seed says, a running request's held blocks may exceed what its tokens need, and the next
allocate_slots asks for max(needed - held, 0) more; they go back to the pool when the request finishes or is
preempted, like every other block of it.

Only requests whose sampling the rejection sampler reproduces exactly draft (worker/rejection_sampler.py):
temperature, top-k, top-p and min-p. Requests with penalties, logit bias, allowed or bad words, min_tokens not
yet reached, a seed, logprobs or structured outputs decode one token a step as without speculation.
With async scheduling a request that may draft is not scheduled while its step runs (its drafts start after the
token that step samples, which only the answer brings); the others keep async scheduling's overlap.
"""

from engine_core.request import Request
from engine_core.spec_decode.ngram_proposer import NgramProposer
from protocol import SamplingParams
from protocol.speculative import SpeculativeConfig


def can_draft(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's sampling is plain enough for the rejection sampler to reproduce exactly."""
    return (params.seed is None and params.logprobs is None and params.structured_outputs is None
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0 and not params.logit_bias and params.allowed_token_ids is None
            and not params.bad_words_token_ids and num_output_tokens >= params.min_tokens)


class SpecDecoding:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.num_speculative_tokens is not None
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                      config.prompt_lookup_max)
        self.num_drafts = 0  # totals since start-up, for the metrics
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def may_draft(self, request: Request) -> bool:
        """Whether the rejection sampler reproduces the request's sampling exactly (see above)."""
        return can_draft(request.sampling_params, len(request.output_token_ids))

    def draft(self, request: Request, num_new_tokens: int, token_budget: int, length_limit: int) -> list[int]:
        """A decoding request's drafts (one uncomputed token, none in flight), kept on request.spec_token_ids until
        the step's answer: at most budget - 1, and none past its length limit (the step gives 1 + len(drafts))."""
        drafts: list[int] = []
        if num_new_tokens == 1 and not request.num_output_placeholders and self.may_draft(request):
            max_drafts = min(token_budget, length_limit - len(request.all_token_ids)) - 1
            drafts = self.proposer.propose(request.all_token_ids, max_drafts)
        request.spec_token_ids = drafts
        return drafts

    def on_output(self, request: Request, num_sampled: int) -> None:
        """A step that verified request.spec_token_ids gave num_sampled tokens: the accepted drafts and one more."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        num_accepted = num_sampled - 1
        request.num_computed_tokens -= len(drafts) - num_accepted
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
