"""The request bodies of the OpenAI API, decoded with msgspec (unknown fields are ignored, as OpenAI's are)."""

import msgspec

# text, token ids, or a list of either (msgspec takes one array type in a union: checked in prompts.py)
Prompt = str | list


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's -1 (off) is accepted too
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    return_token_ids: bool = False  # an extension: each choice (or chunk) also carries its token ids


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Prompt
    max_tokens: int | None = 16


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[dict]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]
