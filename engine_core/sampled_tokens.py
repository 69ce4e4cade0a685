"""What a step's sampled tokens mean to its requests: each request's row, and where a request stops."""

from collections.abc import Iterable
from itertools import repeat

from engine_core.request import Request, RequestStatus
from protocol import ModelRunnerOutput, SchedulerOutput, TokenLogprobs


def check_stop(
    request: Request, token_ids: list[int], eos_token_ids: frozenset[int], max_model_len: int
) -> tuple[int, RequestStatus | None]:
    """How many of token_ids the request takes, and why it finishes at the last of them (None: it goes on)."""
    params = request.sampling_params
    stop_ids = request.stop_token_ids
    eos_ids = () if params.ignore_eos else eos_token_ids
    # The n-th token (from 1) reaches max_tokens or max_model_len when n >= limit.
    limit = min(params.max_tokens - len(request.output_token_ids), max_model_len - len(request.all_token_ids))
    for n, token in enumerate(token_ids, 1):
        if token in stop_ids or token in eos_ids:
            return n, RequestStatus.FINISHED_STOPPED
        if n >= limit:
            return n, RequestStatus.FINISHED_LENGTH_CAPPED
    return len(token_ids), None


def sampled_rows(
    scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
) -> Iterable[tuple[str, list[int] | None, TokenLogprobs | None]]:
    """Per scheduled request in schedule order: its sampled tokens and logprobs (None where the runner gave none)."""
    scheduled = scheduler_output.num_scheduled_tokens
    req_ids, sampled, logprobs = (
        model_runner_output.req_ids, model_runner_output.sampled_token_ids, model_runner_output.logprobs
    )
    columns_match = len(sampled) == len(req_ids) and (logprobs is None or len(logprobs) == len(req_ids))
    if columns_match and req_ids == list(scheduled):  # the usual answer: one row per request, in schedule order
        return zip(req_ids, sampled, logprobs or repeat(None), strict=False)
    sampled_of = dict(zip(req_ids, sampled, strict=False))
    logprobs_of = dict(zip(req_ids, logprobs or [], strict=False))
    return ((req_id, sampled_of.get(req_id), logprobs_of.get(req_id)) for req_id in scheduled)
