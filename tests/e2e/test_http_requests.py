"""Hostile request bodies through a real `kvengine serve`: each is a 400 (or 404, 405, 413) in OpenAI's error shape
naming what is wrong, never a 500, a 503 or a traceback, and the server goes on serving the same tokens.

One server serves the module; the last test checks its log and its greedy tokens.
"""

import asyncio
import json

import pytest

from tests.e2e.conftest import ServerProcess, wait_until
from tests.e2e.http_support import ANSWER_WAIT, SMALL, api_pids, error_of, idle, raw_exchange, rss_mib, send
from tests.e2e.openai_server import ApiServer
from tests.e2e.serve_support import free_port

GOOD = {"prompt": [5, 17, 300, 42, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}
DEEP = "[" * 1000 + "]" * 1000
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    port = free_port()
    server = ServerProcess(tmp_path_factory.mktemp("http_requests"), ["--port", str(port), *SMALL])
    try:
        asyncio.run(server.wait_ready())
        api = ApiServer(server, port)
        assert wait_until(lambda: api.health() == 200, ANSWER_WAIT), server.output()
        yield api
    finally:
        server.stop()


@pytest.fixture(scope="module")
def greedy(api) -> list[int]:
    status, answer, _ = send(api, "POST", "/v1/completions", GOOD)
    assert status == 200
    return answer["choices"][0]["token_ids"]


def refused(api, path: str, status: int, param: str | None, body: object = None, raw: bytes | None = None,
            method: str = "POST") -> dict:
    got, answer, _ = send(api, method, path, body, raw=raw)
    error = error_of(answer)
    assert (got, error["code"], error["param"]) == (status, status, param), answer
    return error


def test_an_8mb_text_prompt_is_refused_before_tokenising_and_a_100mb_body_before_reading(api, greedy):
    [pid] = api_pids(api)
    before = rss_mib(pid)
    error = refused(api, "/v1/completions", 400, "prompt", raw=json.dumps({"prompt": "a" * 8_000_000}).encode())
    assert "maximum context length is 256 tokens" in error["message"]
    head = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n"
    answer = raw_exchange(api.port, head)  # answered and closed without the body being sent
    assert answer.startswith(b"HTTP/1.1 413 ") and b'"code":413' in answer
    assert rss_mib(pid) < before + 128  # tokenising the 8 MB text took 1.6 GB


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", f'{{"prompt": {DEEP}}}', "prompt"),
    ("/v1/completions", f'{{"prompt": "hi", "stop": {DEEP}}}', "stop"),
    ("/v1/completions", f'{{"prompt": "hi", "logit_bias": {{"5": {DEEP}}}}}', "logit_bias"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {DEEP}}}]}}', "messages"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "hi", "tool_calls": {DEEP}}}]}}',
     "messages"),
    ("/v1/chat/completions", f'{{"messages": [], "chat_template_kwargs": {{"a": {DEEP}}}}}', "chat_template_kwargs"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "hi", "x": {DEEP}}}]}}', "messages"),
    ("/detokenize", f'{{"tokens": {DEEP}}}', "tokens"),
])
def test_json_nested_1000_deep_is_a_400_naming_the_field(api, path, body, param):
    refused(api, path, 400, param, raw=body.encode())


@pytest.mark.parametrize("prompt", [[2**64], [2**70], [-(2**63) - 1], [[5, 2**64]], [[True, 5]], [[5, 6], [7, -1]],
                                    [5, 6.5]])
def test_prompt_ids_out_of_range_or_not_integers_are_a_400_naming_prompt(api, prompt):
    refused(api, "/v1/completions", 400, "prompt", {"prompt": prompt, "max_tokens": 2})


@pytest.mark.parametrize("content", [5, {"a": 1}, True, [{"type": "image_url"}], [{"type": "text", "text": 5}]])
def test_chat_content_of_another_type_is_a_400_naming_it(api, content):
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": content}]
    refused(api, "/v1/chat/completions", 400, "messages[1].content", {"messages": messages, "max_tokens": 2})


def test_a_null_content_on_an_assistant_turn_with_tool_calls_is_accepted(api):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    status, answer, _ = send(api, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert status == 200 and answer["choices"][0]["finish_reason"]


@pytest.mark.parametrize("name", ["messages", "bos_token", "add_generation_prompt", "eos_token"])
def test_chat_template_kwargs_naming_a_render_argument_is_a_400(api, name):
    body = {"messages": USER, "chat_template_kwargs": {name: "x"}}
    error = refused(api, "/v1/chat/completions", 400, "chat_template_kwargs", body)
    assert name in error["message"]


@pytest.mark.parametrize("tokens", [[-1], [2**32], [2**64], [5, True], [1.5]])
def test_detokenize_ids_out_of_range_are_a_400_naming_tokens(api, tokens):
    refused(api, "/detokenize", 400, "tokens", {"tokens": tokens})


@pytest.mark.parametrize(("extra", "param"), [
    ({"logit_bias": {"99999999": 5}}, "logit_bias"), ({"logit_bias": {"x": 5}}, "logit_bias"),
    ({"use_beam_search": True}, "use_beam_search"), ({"logits_processors": ["m.P"]}, "logits_processors"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"), ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    ({"priority": 1}, "priority"), ({"suffix": "x"}, "suffix"), ({"n": 0}, "n"), ({"best_of": 0}, "best_of"),
    ({"user_defined": 1}, "user_defined"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"cache_salt": ""}, "cache_salt"),
    ({"stop": ["x"] * 17}, "stop"), ({"tools": []}, "tools"), ({"response_format": {"type": "json"}}, "response_format"),
])
def test_a_parameter_the_server_does_not_honour_is_refused_by_name(api, extra, param):
    refused(api, "/v1/completions", 400, param, {"prompt": "hi", "max_tokens": 2, **extra})


def test_neutral_values_of_those_parameters_are_accepted(api, greedy):
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0,
               "logit_bias": {}, "echo": False, "best_of": 1, "n": 1, "skip_special_tokens": True}
    status, answer, _ = send(api, "POST", "/v1/completions", {**GOOD, **neutral})
    assert status == 200 and answer["choices"][0]["token_ids"] == greedy


def test_chat_over_the_prompt_limit_in_characters_is_refused_by_name(api):
    error = refused(api, "/v1/chat/completions", 400, "messages",
                    {"messages": [{"role": "user", "content": "a" * 100_000}]})
    assert "maximum context length" in error["message"]


def test_404_405_and_a_malformed_http_request_answer_in_openais_shape(api):
    assert refused(api, "/no/such/route", 404, None, method="GET")["type"] == "NotFoundError"
    assert refused(api, "/v1/completions", 405, None, method="GET")["type"] == "MethodNotAllowedError"
    answer = raw_exchange(api.port, b"NOT HTTP AT ALL\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and error_of(json.loads(body))["code"] == 400


def test_the_server_still_serves_the_same_tokens_and_logged_no_traceback(api, greedy):
    status, answer, _ = send(api, "POST", "/v1/completions", GOOD)
    assert status == 200 and answer["choices"][0]["token_ids"] == greedy
    assert wait_until(lambda: idle(api), ANSWER_WAIT)
    assert "Traceback" not in api.server.output() and "Exception in ASGI" not in api.server.output()
