"""Prompt log-probabilities from the worker reach the client's output: on the first token's output, kept when a
slow client's outputs merge in its backlog."""

from engine_core.client_router import Backlog
from engine_core.prompt_logprobs import attach_prompt_logprobs
from protocol import EngineCoreOutput, ModelRunnerOutput, TokenLogprobs

LPS = [TokenLogprobs(-1.5, [3], [-0.5]), TokenLogprobs(-2.0, [4], [-0.1])]


def test_attached_to_the_output_of_the_request_they_belong_to():
    outputs = [EngineCoreOutput("a", [7]), EngineCoreOutput("b", [8])]
    runner = ModelRunnerOutput(step=1, req_ids=["a", "b", "c"], sampled_token_ids=[[7], [8], []],
                               prompt_logprobs=[None, LPS, None])
    attach_prompt_logprobs(outputs, runner)
    assert outputs[0].prompt_logprobs is None and outputs[1].prompt_logprobs == LPS


def test_kept_when_a_backlog_merges_outputs():
    backlog = Backlog()
    backlog.add_outputs([EngineCoreOutput("a", [7], prompt_logprobs=LPS)])
    backlog.add_outputs([EngineCoreOutput("a", [9], "length")])
    merged = backlog.outputs["a"]
    assert merged.new_token_ids == [7, 9] and merged.prompt_logprobs == LPS
    empty = Backlog()
    empty.add_outputs([EngineCoreOutput("b", [1], prompt_logprobs=[])])
    empty.add_outputs([EngineCoreOutput("b", [2])])
    assert empty.outputs["b"].prompt_logprobs == []
