"""Sampling parameters of one request, validated on construction and on decode.

Every bound is one the worker can hold (int64 tensors, float32 logits). msgspec runs __post_init__ on
decode too, so its checks are the one place the bounds are applied; list and map sizes are also type
bounds, so that decode refuses a long one from its header before building it. Token ids are checked
against the model's vocabulary by the engine core, which knows it (engine_core/sampling_checks.py).

The sampling controls follow vLLM's SamplingParams and are applied by the worker's sampler in vLLM's
order: allowed_token_ids, bad words, min_tokens and logit_bias, then the repetition, frequency and
presence penalties (also when sampling greedily), then temperature, min_p, top-k and top-p; a request with
structured_outputs has its grammar's bitmask applied to the logits before all of them.
"""

from typing import Annotated

import msgspec

from protocol.structured_output import StructuredOutputsParams

MAX_INT32 = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_TOKEN_IDS = 1024
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
GREEDY_TEMPERATURE = 1e-5  # below this a request samples greedily, as in vLLM: logits / 1e-45 overflow float32
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2], as OpenAI's and vLLM's
# A repetition penalty divides or multiplies float32 logits: bounded so that neither overflows nor underflows.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one bias: [-100, 100]
MAX_TOKEN_ID_ENTRIES = 1 << 18  # logit_bias entries and allowed_token_ids: more than any vocabulary here
MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 1024, 128
MAX_N = 128  # sequences per prompt (n, best_of), as OpenAI's n

TokenIdList = Annotated[list[int], msgspec.Meta(max_length=MAX_TOKEN_ID_ENTRIES)]
BadWord = Annotated[list[int], msgspec.Meta(max_length=MAX_BAD_WORD_TOKENS)]


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:  # also refuses NaN
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")


def _check_count(name: str, n: int, limit: int) -> None:
    if n > limit:
        raise ValueError(f"{name} has {n} entries, more than the limit of {limit}")


def _check_token_ids(name: str, ids: list[int] | dict[int, float], limit: int) -> None:
    """The count first (never quoting the list), then each id."""
    _check_count(name, len(ids), limit)
    for token in ids:
        _check_range(f"{name} entries", token, 0, MAX_INT32)


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0  # 0 disables top-k; so does any value above the vocabulary size
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's log-probability and the k most likely
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted once per time a token was generated
    repetition_penalty: float = 1.0  # divides positive, multiplies negative logits of prompt and output tokens
    min_p: float = 0.0  # drops tokens less likely than min_p times the most likely one (after temperature)
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many outputs
    logit_bias: Annotated[dict[int, float], msgspec.Meta(max_length=MAX_TOKEN_ID_ENTRIES)] = {}
    allowed_token_ids: TokenIdList | None = None  # only these tokens can be sampled
    # token id sequences never generated: the last id is barred wherever the others were just generated
    bad_words_token_ids: Annotated[list[BadWord], msgspec.Meta(max_length=MAX_BAD_WORDS)] = []
    # None: none; k: each prompt token's log-probability (from the second on) and the k most likely there
    prompt_logprobs: int | None = None
    # n sequences per prompt; best_of (>= n) are sampled and the n with the highest cumulative log-probability
    # returned. The client fans them out (launch/client/parallel_sampling.py); an engine core request has n = 1.
    n: int = 1
    best_of: int | None = None
    # the output must match a JSON schema, a regex, a choice or a grammar (engine_core/structured_output/)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_range("max_tokens", self.max_tokens, 1, MAX_INT32)
        _check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_range("top_k", self.top_k, 0, MAX_INT32)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_range("seed", self.seed, INT64_MIN, INT64_MAX)
        if (n := len(self.stop_token_ids)) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {n} ids, more than the limit of {MAX_STOP_TOKEN_IDS}")
        for token in self.stop_token_ids:
            _check_range("stop_token_ids entries", token, 0, MAX_INT32)
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        self._check_controls()

    def _check_controls(self) -> None:
        _check_range("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _check_range("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("min_tokens", self.min_tokens, 0, MAX_INT32)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check_token_ids("logit_bias", self.logit_bias, MAX_TOKEN_ID_ENTRIES)
        for bias in self.logit_bias.values():
            _check_range("logit_bias values", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty (leave it out to allow every token)")
            _check_token_ids("allowed_token_ids", self.allowed_token_ids, MAX_TOKEN_ID_ENTRIES)
        _check_range("n", self.n, 1, MAX_N)
        if self.best_of is not None:
            _check_range("best_of", self.best_of, self.n, MAX_N)
        if self.prompt_logprobs is not None:
            _check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        _check_count("bad_words_token_ids", len(self.bad_words_token_ids), MAX_BAD_WORDS)
        for word in self.bad_words_token_ids:
            if not word:
                raise ValueError("bad_words_token_ids entries must not be empty")
            _check_token_ids("bad_words_token_ids entries", word, MAX_BAD_WORD_TOKENS)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def num_sequences(self) -> int:
        """Sequences sampled for the prompt: best_of, or n."""
        return self.best_of or self.n

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or self.repetition_penalty != 1.0
