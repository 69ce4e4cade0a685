"""Sampling parameters of one request, validated on construction and on decode.

Every bound is one the worker can hold (int64 tensors, float32 logits). msgspec runs __post_init__ on
decode too, so its checks are the one place the bounds are applied; the stop-id count is also a type
bound, so that decode refuses a long list before building it.
"""

from typing import Annotated

import msgspec

MAX_INT32 = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_TOKEN_IDS = 1024
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs
GREEDY_TEMPERATURE = 1e-5  # below this a request samples greedily, as in vLLM: logits / 1e-45 overflow float32


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:  # also refuses NaN
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value!r}")


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) means greedy
    top_k: int = 0  # 0 disables top-k; so does any value above the vocabulary size
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the sampled token's log-probability and the k most likely

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

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE
