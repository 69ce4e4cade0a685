"""The request bodies of the OpenAI API, decoded with msgspec.

A field the server does not know is refused by name (400), never dropped. Parameters of OpenAI's or vLLM's API
that the engine does not honour yet are declared so that their neutral value (what a client sends when it does
not use them) is accepted and any other value is refused by name; see `unsupported`.
"""

import msgspec

# text, token ids, or a list of either (msgspec takes one array type in a union: checked in prompts.py)
Prompt = str | list
MAX_CACHE_SALT_CHARS = 256


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # not honoured yet: refused when true


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None


class _Sampling(_Request, kw_only=True):
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
    cache_salt: str | None = None  # vLLM's: prompts with different salts never share cached prefixes
    # a structured output (launch/api_server/structured.py): OpenAI's, vLLM's, and vLLM's older guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # not honoured yet: accepted only at their neutral value
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # the detokenizer skips them: true is what it does


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[dict]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    # tool calling (launch/api_server/tools/): the tools reach the chat template; auto, required or a named call
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most


class TokenizeRequest(_Request, kw_only=True):
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request, kw_only=True):
    tokens: list[int]


# parameter -> the values that mean "not used"
NEUTRAL: dict[str, tuple[object, ...]] = {
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "repetition_penalty": (None, 1),
    "min_p": (None, 0), "min_tokens": (None, 0), "logit_bias": (None, {}), "prompt_logprobs": (None,),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,), "echo": (False,), "best_of": (None, 1),
    "suffix": (None,),
}


def unsupported(req: _Sampling) -> str | None:
    """The first parameter set to a value the engine does not honour yet, or None."""
    for name, neutral in NEUTRAL.items():
        if getattr(req, name, neutral[0]) not in neutral:  # the schema fixes each value's type
            return name
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        return "stream_options"
    return None
