"""Why the scheduler can never run a request: checked when it arrives, so it is refused at once with the reason."""

from typing import TYPE_CHECKING

from engine_core.kv_cache.planning import blocks_per_request
from engine_core.sampling_checks import sampling_error
from protocol import EngineCoreRequest

if TYPE_CHECKING:
    from engine_core.scheduler import Scheduler


def request_error(scheduler: "Scheduler", req: EngineCoreRequest) -> str | None:
    """The reason the request can never run on this scheduler; None if it can."""
    if req.request_id in scheduler.requests:
        return f"request id {req.request_id!r} is already in use"
    num_prompt = len(req.prompt_token_ids)
    if num_prompt == 0:
        return "the prompt is empty"
    if num_prompt > scheduler.max_model_len:
        return f"the prompt has {num_prompt} tokens, more than max_model_len={scheduler.max_model_len}"
    vocab_size = scheduler.vocab_size
    if vocab_size is not None and not (min(req.prompt_token_ids) >= 0 and max(req.prompt_token_ids) < vocab_size):
        return f"the prompt has token ids outside the vocabulary [0, {vocab_size})"
    if (error := sampling_error(req.sampling_params, vocab_size)) is not None:
        return error
    full_len = min(num_prompt + req.sampling_params.max_tokens, scheduler.max_model_len)
    groups = scheduler.kv_cache_config.kv_cache_groups
    needed = blocks_per_request(groups, full_len, scheduler.config.max_num_batched_tokens)
    if needed > scheduler.num_usable_blocks:
        return (
            f"the request needs {needed} KV blocks for {full_len} tokens, more than the whole cache "
            f"({scheduler.num_usable_blocks} blocks); lower max_tokens or the prompt length"
        )
    return None
