"""Every parameter of vLLM's completion and chat request schemas, and what this server does with it.

Honoured parameters are declared in schemas.py and applied where their comment says. The others are declared
too (so the client's value is decoded, never an unknown field) and either refused by name (400) unless they hold
the value that means "not used", or, where vLLM itself ignores them, ignored with a warning in the log as vLLM
logs fields it drops. tests/e2e/test_vllm_parameters.py sends each name and checks which of the three it is.
"""

import logging

from launch.api_server.errors import ApiError

logger = logging.getLogger(__name__)

# name -> (the values that mean "not used", why another value is refused)
REFUSED: dict[str, tuple[tuple[object, ...], str]] = {
    "use_beam_search": ((False, None), "beam search is not supported"),
    "prompt_embeds": ((None,), "prompt embeddings are not supported: send text or token ids"),
    "logits_processors": ((None, []), "custom logits processors are not supported"),
    "vllm_xargs": ((None, {}), "no extension reads extra arguments here"),
    "kv_transfer_params": ((None, {}), "disaggregated serving is not supported"),
    "ec_transfer_params": ((None, {}), "disaggregated serving is not supported"),
    "mm_processor_kwargs": ((None, {}), "multimodal inputs are not supported"),
    "media_io_kwargs": ((None, {}), "multimodal inputs are not supported"),
    "return_prompt_text": ((None, False), "the rendered prompt is not returned (POST /tokenize gives its tokens)"),
    "watermarking": ((None, False), "watermarking is not supported"),
    "logprob_token_ids": ((None,), "logprobs of chosen token ids are not supported: use logprobs"),
    "repetition_detection": ((None,), "repetition detection is not supported"),
    "thinking_token_budget": ((None, -1), "thinking budgets are not supported"),
    "stream_interval": ((None, 1), "tokens per streamed chunk are not configurable: every chunk is sent at once"),
    "routed_experts_prompt_start": ((None, 0), "routed-expert data is not returned"),
    "reasoning_effort": ((None,), "no reasoning parser is configured"),
    "guided_decoding_backend": ((None,), "the structured-output backend is not configurable"),
    "guided_whitespace_pattern": ((None,), "the whitespace of JSON outputs is not configurable"),
    "structural_tag": ((None,), "structural tags are not supported"),
}

# name -> (its default, why vLLM ignores it too)
IGNORED: dict[str, tuple[object, str]] = {
    "user": (None, "an end-user id for the client's own records"),
    "length_penalty": (1.0, "it applies to beam search only"),
    "include_reasoning": (True, "no reasoning parser is configured"),
    "session_id": (None, "sessions are not tracked"),
    "return_token_offsets": (False, "offsets come from the render endpoints only"),
    "return_mm_kwargs": (True, "it applies to the render endpoints only"),
}


def check_parameters(req: object) -> None:
    """Refuse the first declared-but-not-honoured parameter set to a used value; log the ignored ones set."""
    for name, (neutral, why) in REFUSED.items():
        value = getattr(req, name, None)
        if value not in neutral:
            raise ApiError(400, f"{name} is not supported: {why}", name)
    ignored = [name for name, (default, _) in IGNORED.items() if getattr(req, name, default) not in (default, None)]
    if ignored:
        logger.warning("The following fields were present in the request but ignored: %s (%s)", ", ".join(ignored),
                       "; ".join(f"{n}: {IGNORED[n][1]}" for n in ignored))
