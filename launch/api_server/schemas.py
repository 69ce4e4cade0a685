"""The request bodies of the OpenAI API, decoded with msgspec.

A field the server does not know is refused by name (400), never dropped. Every field of vLLM's completion and
chat request schemas is declared: honoured, or refused by name unless it holds the value that means "not used",
or ignored where vLLM ignores it too (parameters.py says which and why).
"""

from typing import Literal

import msgspec

# text, token ids, or a list of either (msgspec takes one array type in a union: checked in prompts.py)
Prompt = str | list
MAX_CACHE_SALT_CHARS = 256


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # every chunk carries the usage so far (with include_usage)


class _Request(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None


class _Sampling(_Request, kw_only=True):
    """The fields both generation routes share. A null where OpenAI's schema allows one means the default."""

    # OpenAI's
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    # vLLM's sampling parameters (request_params.py)
    top_k: int | None = None  # vLLM's -1 (off) is accepted too
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True  # as in vLLM, no effect with a fast (Rust) tokenizer
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: max_model_len)
    truncation_side: Literal["left", "right"] | None = None  # right: keep the first k instead
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    # vLLM's other extensions
    priority: int | None = 0  # lower runs first; needs --scheduling-policy priority
    request_id: str | None = None  # the response's id is built from it
    return_token_ids: bool | None = False  # each choice (or chunk) also carries its token ids
    return_tokens_as_token_ids: bool | None = False  # log-probabilities name tokens "token_id:N"
    cache_salt: str | None = None  # vLLM's: prompts with different salts never share cached prefixes
    # a structured output (launch/api_server/structured.py): OpenAI's, vLLM's, and vLLM's older guided_* fields
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # declared so that a client's value is read, never an unknown field: refused by name unless it means "not
    # used", or ignored as vLLM ignores it (parameters.py)
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    logits_processors: list | None = None
    vllm_xargs: dict | None = None
    kv_transfer_params: dict | None = None
    ec_transfer_params: dict | None = None
    watermarking: bool | None = None
    logprob_token_ids: list[int] | None = None
    repetition_detection: dict | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = None
    routed_experts_prompt_start: int | None = 0
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    user: str | None = None
    session_id: str | None = None
    return_token_offsets: bool | None = False
    return_mm_kwargs: bool | None = True


class CompletionRequest(_Sampling, kw_only=True):
    prompt: Prompt
    max_tokens: int | None = 16
    echo: bool | None = False  # the prompt first (with logprobs: its tokens' log-probabilities first)
    suffix: str | None = None  # refused: no model here has a fill-in-the-middle template
    add_special_tokens: bool | None = True
    prompt_embeds: object = None  # refused (parameters.py)


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[dict]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = None  # null: true, unless continue_final_message
    continue_final_message: bool | None = False  # the last message is continued (no end of turn after it)
    echo: bool | None = False  # vLLM's: the reply starts with the last message when that is the assistant's
    add_special_tokens: bool | None = False  # on top of those the chat template writes
    chat_template: str | None = None  # this request's template, rendered in the same sandbox
    chat_template_kwargs: dict | None = None
    documents: list[dict] | None = None  # handed to the template, as vLLM does
    # tool calling (launch/api_server/tools/): the tools reach the chat template; auto, required or a named call
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most
    reasoning_effort: str | None = None  # refused
    include_reasoning: bool | None = True  # ignored
    mm_processor_kwargs: dict | None = None  # refused
    media_io_kwargs: dict | None = None  # refused
    return_prompt_text: bool | None = None  # refused


class TokenizeRequest(_Request, kw_only=True):
    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request, kw_only=True):
    tokens: list[int]
