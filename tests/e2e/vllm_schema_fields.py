"""The request fields of vLLM's OpenAI server (no tests here): every name its CompletionRequest and
ChatCompletionRequest declare, from vllm/entrypoints/openai/protocol.py and the newer
vllm/entrypoints/openai/{completion,chat_completion}/protocol.py (the union: fields older releases had and newer
ones added)."""

COMPLETION_FIELDS = [
    "model", "prompt", "prompt_embeds", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
    "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
    "top_p", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side",
    "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words", "add_special_tokens",
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "priority", "request_id", "session_id",
    "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start",
    "return_token_offsets", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "thinking_token_budget", "stream_interval",
]

CHAT_FIELDS = [
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream",
    "stream_options", "temperature", "top_p", "tools", "tool_choice", "reasoning_effort",
    "thinking_token_budget", "include_reasoning", "parallel_tool_calls", "user", "best_of", "use_beam_search",
    "top_k", "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
    "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side", "prompt_logprobs",
    "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "structural_tag", "guided_decoding_backend", "guided_whitespace_pattern",
    "priority", "request_id", "session_id", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "routed_experts_prompt_start", "return_token_offsets", "return_prompt_text",
    "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "stream_interval",
]
