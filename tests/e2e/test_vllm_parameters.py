"""Every field of vLLM's completion and chat request schemas sent to a real server (the built-in model): each is
honoured (a check of what it does, most against the native client given the same SamplingParams), refused with a
400 naming it, or, where vLLM ignores it too, ignored with a warning in the log. None is dropped silently."""

import asyncio

import pytest

from launch.client import AsyncEngineClient
from protocol import SamplingParams
from tests.e2e.conftest import ServerProcess, wait_until
from tests.e2e.openai_server import ApiServer
from tests.e2e.serve_support import free_port
from tests.e2e.vllm_parameter_checks import (
    CHECKS,
    IGNORED,
    PROMPT,
    REFUSED,
    USER,
    check_chat_echo,
    ignored,
    ok,
    post,
    refused,
)
from tests.e2e.vllm_schema_fields import CHAT_FIELDS, COMPLETION_FIELDS


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    port = free_port()
    server = ServerProcess(tmp_path_factory.mktemp("vllm_parameters"),
                           ["--port", str(port), "--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB"])
    try:
        asyncio.run(server.wait_ready())
        api = ApiServer(server, port)
        assert wait_until(lambda: api.health() == 200, 120), server.output()
        yield api
    finally:
        server.stop()


@pytest.mark.parametrize("name", COMPLETION_FIELDS)
def test_every_completion_field_is_honoured_refused_or_ignored_by_name(api, name):
    if name in REFUSED:
        return refused(api, name, REFUSED[name])
    if name in IGNORED:
        return ignored(api, name, IGNORED[name])
    CHECKS[name](api)


@pytest.mark.parametrize("name", CHAT_FIELDS)
def test_every_chat_field_is_honoured_refused_or_ignored_by_name(api, name):
    path = "/v1/chat/completions"
    if name in REFUSED:
        return refused(api, name, REFUSED[name], path)
    if name in IGNORED:
        return ignored(api, name, IGNORED[name], path)
    (check_chat_echo if name == "echo" else CHECKS[name])(api, path)


def test_every_field_has_a_check():
    assert set(COMPLETION_FIELDS) | set(CHAT_FIELDS) <= set(CHECKS) | set(REFUSED) | set(IGNORED)


def test_priority_orders_waiting_requests_and_the_chat_template_flag_renders_chats(start_server):
    """With --scheduling-policy priority, requests waiting in the engine's queue run lowest priority value first,
    whatever their arrival: two native requests fill the batch (--max-num-seqs 2), a request of priority 9 and then
    one of priority 0 wait behind them, and when one native request ends the one of priority 0 runs first.
    --chat-template replaces the model's template, and a request's own replaces both."""
    import concurrent.futures

    from tests.e2e.openai_server import start_api_server

    api = start_api_server(start_server, "--scheduling-policy", "priority", "--max-num-seqs", "2", "--chat-template",
                           "{% for m in messages %}[{{ m.content }}]{% endfor %}", "--max-model-len", "512",
                           "--kv-cache-memory-bytes", "8MiB")
    assert ok(api, "/v1/chat/completions")["choices"][0]["prompt_token_ids"] == [3 + b for b in b"[hi]"]
    assert ok(api, "/v1/chat/completions", chat_template="{{ messages[0].content }}!")["choices"][0][
        "prompt_token_ids"] == [3 + b for b in b"hi!"]
    finished: list[int] = []

    def send(priority: int) -> None:
        assert post(api, "/v1/completions", priority=priority, max_tokens=4)[0] == 200
        finished.append(priority)

    async def go() -> None:
        async with AsyncEngineClient(api.server.address) as client:
            long = SamplingParams(max_tokens=400, ignore_eos=True)
            first, second = client.generate(PROMPT, long), client.generate(PROMPT[:4], long)
            await anext(first)
            await anext(second)  # the batch is full
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                later = pool.submit(send, 9)
                assert await waiting(client, 1)
                sooner = pool.submit(send, 0)
                assert await waiting(client, 2)
                await first.aclose()  # aborted: one place in the batch
                await asyncio.to_thread(sooner.result)
                await second.aclose()
                await asyncio.to_thread(later.result)

    asyncio.run(go())
    assert finished == [0, 9]


async def waiting(client: AsyncEngineClient, n: int) -> bool:
    """Whether the engine's queue comes to hold n requests (asked again until it does, or 600 times)."""
    for _ in range(600):
        if (await client.get_stats()).num_waiting_reqs == n:
            return True
        await asyncio.sleep(0.05)
    return False


NULLABLE = {  # OpenAI's schemas allow null for these (and vLLM's top_k and ignore_eos are commonly sent null)
    "/v1/completions": ["best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "n",
                        "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
                        "top_p", "user", "top_k", "ignore_eos"],
    "/v1/chat/completions": ["frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
                             "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop",
                             "stream", "stream_options", "temperature", "top_p", "tools", "tool_choice",
                             "parallel_tool_calls", "user", "top_k", "ignore_eos"],
}


@pytest.mark.parametrize("path", list(NULLABLE))
def test_null_is_the_default_wherever_openai_allows_it(api, path):
    """Every such field null at once: the answer of a request that leaves them out."""
    body = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": USER}
    plain = api.request("POST", path, {**body, "seed": 3, "return_token_ids": True})
    nulls = api.request("POST", path, {**body, **dict.fromkeys(NULLABLE[path]), "seed": 3, "return_token_ids": True})
    assert plain[0] == nulls[0] == 200, nulls
    assert plain[1]["choices"][0]["token_ids"] == nulls[1]["choices"][0]["token_ids"]


def test_a_null_max_tokens_is_the_rest_of_the_context(api):
    """As in vLLM, where a completion's max_tokens left out is 16 and null is what the context leaves."""
    status, body = api.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": None, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 256 - len(PROMPT)
