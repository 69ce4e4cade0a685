"""The engine's SamplingParams for one prompt of a completion or chat request, as vLLM's OpenAI server builds them:
null means the default, logit_bias keys are token ids (each bias clamped to [-100, 100]), bad words become token
id sequences, and a completion with echo asks for the prompt's log-probabilities. SamplingParams bounds the rest;
its refusal names the parameter (400)."""

import math
from collections.abc import Callable

from launch.api_server.errors import ApiError, bad_param
from launch.api_server.prompts import max_tokens_for
from protocol import SamplingParams, StructuredOutputsParams
from protocol.sampling import MAX_LOGIT_BIAS

Encode = Callable[[str, bool], list[int]]  # text, add_special_tokens -> token ids


def engine_params(req, prompt: list[int], max_tokens: int | None, max_model_len: int, encode: Encode,
                  structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """req: a CompletionRequest or ChatCompletionRequest (schemas.py)."""
    try:
        return SamplingParams(
            max_tokens=1 if echo_only(req, max_tokens) else max_tokens_for(prompt, max_tokens, max_model_len),
            temperature=_or(req.temperature, 1.0), top_p=_or(req.top_p, 1.0), top_k=_top_k(req.top_k),
            min_p=_or(req.min_p, 0.0), seed=req.seed, stop_token_ids=req.stop_token_ids or [],
            ignore_eos=bool(req.ignore_eos), logprobs=requested_logprobs(req),
            prompt_logprobs=requested_prompt_logprobs(req),
            presence_penalty=_or(req.presence_penalty, 0.0), frequency_penalty=_or(req.frequency_penalty, 0.0),
            repetition_penalty=_or(req.repetition_penalty, 1.0), min_tokens=_or(req.min_tokens, 0),
            logit_bias=logit_bias(req.logit_bias), allowed_token_ids=req.allowed_token_ids,
            bad_words_token_ids=bad_words_token_ids(req.bad_words, encode), n=_or(req.n, 1), best_of=req.best_of,
            structured_outputs=structured,
        )
    except ValueError as e:  # a chat's alternatives per token are its top_logprobs
        raise bad_param(e, {"logprobs": "top_logprobs"} if hasattr(req, "messages") else None) from None


def _or(value, default):
    return default if value is None else value


def _top_k(top_k: int | None) -> int:
    """vLLM's -1 (and null) mean no top-k, which is 0 here."""
    return 0 if top_k in (None, -1) else top_k  # type: ignore[return-value]


def echo_only(req, max_tokens: int | None) -> bool:
    """A completion with echo and max_tokens 0 (how lm-evaluation-harness scores a text): the engine generates one
    token, which the answer leaves out, as vLLM does."""
    return bool(getattr(req, "echo", False)) and max_tokens == 0 and not hasattr(req, "messages")


def requested_logprobs(req) -> int | None:
    """Alternatives per token, or None for no log-probabilities: completions take logprobs=k (0..20); chat takes
    logprobs=true with top_logprobs=k."""
    if hasattr(req, "messages"):
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None
    if req.top_logprobs is not None:
        raise ApiError(400, "top_logprobs is a chat parameter; completions take logprobs=k", "top_logprobs")
    if isinstance(req.logprobs, bool):
        raise ApiError(400, "logprobs of a completion is the number of alternatives per token (0 to 20)", "logprobs")
    return req.logprobs


def requested_prompt_logprobs(req) -> int | None:
    """vLLM's prompt_logprobs; a completion with echo and logprobs asks for them too (its answer lists the prompt's
    tokens first)."""
    if req.prompt_logprobs is not None or hasattr(req, "messages"):
        return req.prompt_logprobs
    return req.logprobs if req.echo and req.logprobs is not None else None


def logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's map of token id (as a JSON key) to bias, each clamped to [-100, 100] as vLLM does."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias keys are token ids, got {key[:32]!r}", "logit_bias") from None
        if not math.isfinite(value):
            raise ApiError(400, f"logit_bias values are numbers in [-100, 100], got {value!r}", "logit_bias")
        out[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, value))
    return out


def bad_words_token_ids(words: list[str] | None, encode: Encode) -> list[list[int]]:
    """Each word as token ids, as vLLM tokenises bad words: the word without leading spaces, and also with one
    space in front where that starts with another token and takes as many (a word inside a sentence)."""
    out: list[list[int]] = []
    for word in words or []:
        bare = encode(word.lstrip(), False)
        if not bare:
            raise ApiError(400, "bad_words entries must not be empty", "bad_words")
        out.append(bare)
        spaced = encode(" " + word.lstrip(), False)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out
