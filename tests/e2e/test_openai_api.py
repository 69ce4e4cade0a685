"""The OpenAI-compatible HTTP API end to end: the official `openai` client, raw SSE, concurrency, errors, aborts."""

import asyncio
import http.client
import json
import os
import signal
import socket
import threading

import openai
import pytest

from launch.api_server.text_model import load_text_model
from launch.client import AsyncEngineClient
from protocol import SamplingParams
from tests.e2e.conftest import cmdline, processes_in_group, wait_exit, wait_until
from tests.e2e.openai_server import SMALL, sse_events, start_api_server

PROMPT_IDS = [5, 17, 300, 42, 9, 77, 81]


@pytest.fixture
def api(start_server):
    return start_api_server(start_server, *SMALL)


async def native_greedy(address: str, max_tokens: int) -> list[int]:
    """PROMPT_IDS' greedy tokens through the native ZeroMQ client."""
    tokens: list[int] = []
    async with AsyncEngineClient(address) as client:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        async for out in client.generate(PROMPT_IDS, params):
            tokens += out.new_token_ids
    return tokens


def stats(address: str):
    async def get():
        async with AsyncEngineClient(address) as client:
            return await client.get_stats()

    return asyncio.run(get())


def test_openai_client_completions_and_chat_streamed_and_not(api):
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 6
    streamed = client.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_greedy_tokens_over_http_equal_the_native_clients(api):
    request = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
               "return_token_ids": True}
    status, body = api.request("POST", "/v1/completions", request)
    tokens = asyncio.run(native_greedy(api.server.address, 12))
    assert status == 200 and body["usage"]["completion_tokens"] == 12
    assert body["choices"][0]["token_ids"] == tokens
    assert body["choices"][0]["text"] == load_text_model(None).decode(tokens)
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps({**request, "stream": True}))
    chunks = [json.loads(e) for e in sse_events(conn.getresponse()) if e != "[DONE]"]
    conn.close()
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == tokens


def test_raw_sse_stream_with_lists_of_prompts_and_usage(api):
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=120)
    body = {"model": "tiny", "prompt": ["one", "two", "three"], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    events = list(sse_events(response))
    conn.close()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finished = sorted(c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2]
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 12 and usage["prompt_tokens_details"] == {"cached_tokens": 0}


def test_cached_tokens_are_reported_and_reset_prefix_cache_clears_them(api):
    body = {"model": "tiny", "prompt": list(range(3, 60)), "max_tokens": 2, "temperature": 0}
    assert api.request("POST", "/v1/completions", body)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert api.request("POST", "/v1/completions", body)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    assert api.request("POST", "/reset_prefix_cache")[0] == 200
    assert api.request("POST", "/v1/completions", body)[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_many_concurrent_streams(api):
    async def run() -> list[tuple[str, int]]:
        client = openai.AsyncOpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> tuple[str, int]:
            stream = await client.completions.create(
                model="tiny", prompt=[3 + i, 4, 5], max_tokens=16, temperature=0, stream=True,
                extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
            reason, tokens = "", 0
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            return reason, tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(48)))
        finally:
            await client.close()

    assert asyncio.run(run()) == [("length", 16)] * 48
    assert stats(api.server.address).num_running_reqs == 0


def idle_after_abort(api, before_tokens: int, limit: int) -> bool:
    """The engine's pool is back to idle, well before the aborted request's max_tokens were generated."""
    now = stats(api.server.address)
    return now.num_running_reqs == 0 and now.num_blocks_held == 0 and (
        now.num_generation_tokens - before_tokens < limit)


def test_a_client_that_disconnects_aborts_its_stream(start_server):
    api = start_api_server(start_server, "--max-model-len", "2048", "--kv-cache-memory-bytes", "16MiB")
    before = stats(api.server.address).num_generation_tokens
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=120)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    next(sse_events(response))
    conn.close()
    assert wait_until(lambda: stats(api.server.address).num_running_reqs == 0, 120)
    assert idle_after_abort(api, before, 2000)
    assert "Traceback" not in api.server.output()


def test_a_client_that_disconnects_aborts_its_non_streamed_request(start_server):
    api = start_api_server(start_server, "--max-model-len", "2048", "--kv-cache-memory-bytes", "16MiB")
    before = stats(api.server.address).num_generation_tokens
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=120)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    assert wait_until(lambda: stats(api.server.address).num_running_reqs == 1, 120)
    conn.close()
    assert wait_until(lambda: stats(api.server.address).num_running_reqs == 0, 120)
    assert idle_after_abort(api, before, 2000)
    assert "Traceback" not in api.server.output()


@pytest.mark.parametrize(("body", "status", "param", "words"), [
    ({"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature must be"),
    ({"prompt": "hi", "top_p": "x"}, 400, "top_p", "Expected `float | null`"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model", "does not exist"),
    ({"prompt": list(range(3, 300))}, 400, "prompt", "maximum context length is 256"),
    ({"prompt": "hi", "max_tokens": 1000}, 400, "max_tokens", "maximum context length is 256"),
    ({"prompt": "hi", "n": 0}, 400, "n", "n must be in [1, 128]"),
    ({"prompt": []}, 400, "prompt", "empty"),
])
def test_errors_have_openais_shape_and_status(api, body, status, param, words):
    got, answer = api.request("POST", "/v1/completions", body)
    assert got == status and answer["error"]["param"] == param and words in answer["error"]["message"]
    assert answer["error"]["code"] == status and answer["error"]["type"]


def test_openai_client_raises_its_own_errors(api):
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.completions.create(model="tiny", prompt="hi", extra_body={"top_k": -5})


def test_an_engine_overloaded_by_another_client_answers_503(start_server):
    api = start_api_server(start_server, *SMALL, "--max-pending-requests", "1")

    async def run() -> tuple[int, dict | str]:
        async with AsyncEngineClient(api.server.address) as client:  # a native client holds the only place
            params = SamplingParams(max_tokens=240, temperature=0, ignore_eos=True)
            outputs = client.generate(PROMPT_IDS, params)
            await anext(outputs)
            try:
                return await asyncio.to_thread(api.request, "POST", "/v1/completions", {"prompt": "hi"})
            finally:
                await outputs.aclose()

    status, answer = asyncio.run(run())
    assert status == 503 and "overloaded" in answer["error"]["message"]


def test_tokenize_detokenize_version_models(api):
    status, tokens = api.request("POST", "/tokenize", {"prompt": "héllo"})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    assert api.request("POST", "/detokenize", {"tokens": tokens["tokens"]}) == (200, {"prompt": "héllo"})
    chat = api.request("POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[1]
    assert api.request("POST", "/detokenize", {"tokens": chat["tokens"]})[1]["prompt"] == "user\nhi\nassistant\n"
    assert api.request("GET", "/version")[1]["version"]
    assert api.request("GET", "/v1/models")[1]["data"][0]["max_model_len"] == 256


def test_metrics_are_the_engines_prometheus_registry(api):
    api.request("POST", "/v1/completions", {"prompt": [3, 4, 5], "max_tokens": 3, "ignore_eos": True})

    def generated() -> float:
        status, text = api.request("GET", "/metrics")
        assert status == 200 and isinstance(text, str)
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        return float(samples["kvengine:generation_tokens_total"])

    assert wait_until(lambda: generated() >= 3, 60)  # the engine publishes its counters every stats interval


def test_several_api_processes_share_the_port(start_server):
    api = start_api_server(start_server, *SMALL, "--api-server-count", "2")
    processes = [p for p in processes_in_group(api.server.proc.pid) if "launch.api_server.process" in cmdline(p)]
    assert len(processes) == 2

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)
        try:
            done = await asyncio.gather(*(client.completions.create(
                model="tiny", prompt=[3, i], max_tokens=4, extra_body={"ignore_eos": True}) for i in range(32)))
        finally:
            await client.close()
        return [d.choices[0].finish_reason for d in done]

    assert asyncio.run(run()) == ["length"] * 32


def test_a_dead_engine_answers_503(start_server):
    api = start_api_server(start_server, "--max-model-len", "2048", "--kv-cache-memory-bytes", "16MiB")
    answer: list[tuple[int, dict | str]] = []
    thread = threading.Thread(target=lambda: answer.append(api.request("POST", "/v1/completions", {
        "prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True})))
    thread.start()
    assert wait_until(lambda: stats(api.server.address).num_running_reqs == 1, 120)
    os.kill(api.server.worker_pids()[0], signal.SIGKILL)
    thread.join()
    status, body = answer[0]
    assert status == 503 and isinstance(body, dict) and body["error"]["code"] == 503


def test_stop_token_ids_end_the_choice(api):
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "ignore_eos": True}

    tokens = asyncio.run(native_greedy(api.server.address, 12))
    stop_at = tokens.index(tokens[4])  # the first place the fifth token appears
    status, answer = api.request("POST", "/v1/completions", {**body, "stop_token_ids": [tokens[4]]})
    assert status == 200 and answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == stop_at + 1


def test_a_taken_http_port_is_a_clear_start_up_error(start_server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = start_server("--port", str(port), *SMALL)
        assert wait_exit(server.proc) == 1
    assert f"cannot listen on http://127.0.0.1:{port}" in server.output() and "Traceback" not in server.output()


def test_a_refused_prompt_in_a_list_aborts_the_others(api):
    body = {"prompt": [[5, 6, 7], [5, 6, 1 << 20]], "max_tokens": 200, "ignore_eos": True}
    status, answer = api.request("POST", "/v1/completions", body)
    assert status == 400 and "outside the vocabulary" in answer["error"]["message"]
    assert wait_until(lambda: stats(api.server.address).num_running_reqs == 0, 120)
