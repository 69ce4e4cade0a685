"""Prompt log-probabilities on their way out: the worker hands them over with a request's first sampled token,
and they ride on that token's EngineCoreOutput."""

from protocol import EngineCoreOutput, ModelRunnerOutput


def attach_prompt_logprobs(outputs: list[EngineCoreOutput], model_runner_output: ModelRunnerOutput) -> None:
    """Give each output of a request whose prompt log-probabilities came in this step its list."""
    given = model_runner_output.prompt_logprobs
    if given is None:
        return
    by_request = {r: lp for r, lp in zip(model_runner_output.req_ids, given, strict=False) if lp is not None}
    for out in outputs:
        if out.request_id in by_request:
            out.prompt_logprobs = by_request[out.request_id]
