"""10,000 seeded hostile HTTP requests against one real server, 16 at a time, across every route: mutated and
truncated bodies, values of every type and size, ids out of range, chat contents, broken and oversized headers,
keys right and wrong, slow clients that stall and clients that vanish mid-request.

Every answer must be a status the API gives on purpose (never a 500) with an error in OpenAI's shape; afterwards
the server answers a good request with the same greedy tokens, the engine holds no KV block, no process died,
the API process's memory is flat and its log holds no traceback.
"""

import asyncio
import copy
import json
import random

from tests.e2e.conftest import wait_until
from tests.e2e.http_support import ANSWER_WAIT, SMALL, api_pids, error_of, idle, rss_mib, send
from tests.e2e.openai_server import start_api_server

SEED, CASES, WARM_UP, CONCURRENCY = 26, 10_000, 2_000, 16
KEY, ADMIN = "fuzz-key", "fuzz-admin"
FLAGS = [*SMALL, "--api-key", f"{KEY},other-key", "--admin-api-key", ADMIN, "--http-header-timeout", "1",
         "--http-body-timeout", "1", "--http-keep-alive-timeout", "1", "--max-http-connections", "64",
         "--max-request-body-bytes", "256KiB", "--max-user-requests", "64"]
GOOD = {"prompt": [5, 17, 300, 42, 9], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
ROUTES = [
    ("POST", "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}),
    ("POST", "/v1/completions", {"prompt": ["one", "two"], "max_tokens": 3, "stream": True}),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4}),
    ("POST", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 3, "stream": True,
                                      "stream_options": {"include_usage": True}}),
    ("POST", "/tokenize", {"prompt": "héllo"}), ("POST", "/tokenize", {"messages": CHAT}),
    ("POST", "/detokenize", {"tokens": [5, 6, 7]}), ("GET", "/v1/models", None), ("GET", "/health", None),
    ("GET", "/version", None), ("GET", "/metrics", None), ("POST", "/reset_prefix_cache", None),
    ("GET", "/v1/completions", None), ("POST", "/v1/nothing", {}),
]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "stop_token_ids", "ignore_eos", "n", "stream", "stream_options", "logprobs", "top_logprobs",
          "return_token_ids", "cache_salt", "logit_bias", "presence_penalty", "echo", "best_of", "model", "tokens",
          "chat_template_kwargs", "add_generation_prompt", "add_special_tokens", "suffix", "min_tokens"]
# statuses the API answers on purpose; 503: too many connections at once (the cap is 64 here)
EXPECTED = {200, 400, 401, 403, 404, 405, 408, 409, 413, 429, 503}


def junk(rng: random.Random) -> object:
    """A value of any JSON type and size."""
    choices = [None, True, False, 0, -1, 1, 7, 2**31, 2**32, 2**63, 2**64, -(2**63) - 1, 2**70, 1e308, -1e-300, 0.5,
               "", "x", "tiny", "é" * 50, "\u0000\ud7ff", "a" * rng.choice([100, 5_000, 100_000]), [], [5, 6],
               [-1], [[5, 2**64]], [True, 5], ["a", 1], {}, {"a": 1}, {"5": 1.0}, {"role": "user", "content": None},
               [{"role": "user", "content": rng.choice([None, 5, {"a": 1}, True, [{"type": "text", "text": "x"}]])}],
               [{"type": "image_url"}], {"messages": 1}, {"bos_token": "x"}]
    value = rng.choice(choices)
    if rng.random() < 0.08:
        depth = rng.choice([10, 40, 200, 1000])
        value = json.loads("[" * depth + "]" * depth) if depth < 900 else "[" * depth + "]" * depth
    return value


def mutated(rng: random.Random, body: dict | None) -> bytes:
    out = copy.deepcopy(body) if body is not None else {}
    for _ in range(rng.randint(0, 3)):
        roll = rng.random()
        if roll < 0.55:
            out[rng.choice(FIELDS)] = junk(rng)
        elif roll < 0.65 and out:
            out.pop(rng.choice(list(out)))
        elif roll < 0.75:
            out[f"unknown_{rng.randint(0, 9)}"] = junk(rng)
        elif isinstance(out.get("messages"), list) and out["messages"]:
            message = rng.choice(out["messages"])
            message = {**message} if isinstance(message, dict) else {}
            message[rng.choice(["role", "content", "name", "tool_calls"])] = junk(rng)
            out["messages"] = [*out["messages"], message]
    text = json.dumps(out) if body is not None or out else ""
    text = text.replace('"[[[[', "[[[[").replace(']]]]"', "]]]]")  # a 1000-deep string becomes real nesting
    roll = rng.random()
    if roll < 0.05:
        text = text[:rng.randint(0, len(text))]
    elif roll < 0.07:
        return rng.randbytes(rng.randint(1, 300))
    return text.encode()


def head(rng: random.Random, method: str, path: str, body: bytes) -> bytes:
    auth = rng.choices([f"Bearer {KEY}", f"Bearer {ADMIN}", "Bearer wrong", "Basic x", None], [80, 5, 5, 2, 8])[0]
    length = rng.choices([str(len(body)), str(len(body) + 10), str(max(len(body) - 3, 0)), "abc", "-1",
                          "99999999999"], [90, 2, 2, 2, 2, 2])[0]
    lines = [f"{method} {path} HTTP/1.1", "Host: fuzz", "Content-Type: application/json", f"Content-Length: {length}",
             "Connection: close"]
    if auth is not None:
        lines.append(f"Authorization: {auth}")
    roll = rng.random()
    if roll < 0.02:
        lines.append("X-Big: " + "b" * rng.choice([1_000, 20_000, 70_000]))
    elif roll < 0.04:
        lines += [f"X-{i}: {i}" for i in range(300)]
    elif roll < 0.06:
        lines[0] = rng.choice(["BREW /v1/completions HTTP/1.1", f"POST /{'x' * 9000} HTTP/1.1", "POST /v1/%00 HTTP/1.1",
                               f"{method} {path} HTTP/9.9", "GET\t/health HTTP/1.1", "POST /v1/completions"])
    elif roll < 0.07:
        lines.append("X-Bad: \xff\xfe")
    elif roll < 0.08:
        lines.append("Expect: 100-continue")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """(status, body) of one HTTP/1.1 response (Content-Length, chunked, or until close)."""
    head_bytes = await reader.readuntil(b"\r\n\r\n")
    while head_bytes.startswith(b"HTTP/1.1 100 "):  # Expect: 100-continue
        head_bytes = await reader.readuntil(b"\r\n\r\n")
    status = int(head_bytes.split(b" ", 2)[1])
    headers = dict(line.split(b":", 1) for line in head_bytes.split(b"\r\n")[1:] if b":" in line)
    headers = {k.strip().lower(): v.strip() for k, v in headers.items()}
    if b"content-length" in headers:
        return status, await reader.readexactly(int(headers[b"content-length"]))
    if headers.get(b"transfer-encoding") == b"chunked":
        body = b""
        while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
            body += await reader.readexactly(size + 2)
        return status, body
    return status, await reader.read()


async def one_case(port: int, index: int, slow: list) -> int | None:
    """One hostile exchange; its status (None for clients that vanish or stall)."""
    rng = random.Random(SEED * 1_000_003 + index)
    method, path, body = rng.choice(ROUTES)
    data = mutated(rng, body)
    request = head(rng, method, path, data) + data
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    roll = rng.random()
    if roll < 0.03:  # a slow client: part of the request, then nothing (the timeouts must end it)
        writer.write(request[:rng.randint(1, len(request) - 1)] if len(request) > 1 else request)
        slow.append(writer)
        return None
    writer.write(request)
    try:
        if roll < 0.08:  # a client that vanishes mid-request
            await asyncio.sleep(rng.random() / 20)
            return None
        status, answer = await asyncio.wait_for(read_response(reader), ANSWER_WAIT)
    finally:
        if roll >= 0.03:
            writer.close()
    assert status in EXPECTED, (index, status, answer[:300])
    if status >= 400:
        error_of(json.loads(answer))
    return status


async def fuzz(port: int, cases: range) -> dict[int | None, int]:
    gate = asyncio.Semaphore(CONCURRENCY)
    slow: list = []
    counts: dict[int | None, int] = {}

    async def run(index: int) -> None:
        async with gate:
            status = await one_case(port, index, slow)
            counts[status] = counts.get(status, 0) + 1

    await asyncio.gather(*(run(i) for i in cases))
    for writer in slow:
        writer.close()
    return counts


def test_10000_hostile_requests_leave_the_server_serving_the_same_tokens(start_server):
    api = start_api_server(start_server, *FLAGS)
    auth = {"Authorization": f"Bearer {KEY}"}
    before = send(api, "POST", "/v1/completions", GOOD, auth)[1]["choices"][0]["token_ids"]
    [pid], workers = api_pids(api), api.server.worker_pids()
    counts = asyncio.run(fuzz(api.port, range(WARM_UP)))
    warm = rss_mib(pid)
    counts_rest = asyncio.run(fuzz(api.port, range(WARM_UP, CASES)))
    for status, n in counts_rest.items():
        counts[status] = counts.get(status, 0) + n
    print(f"statuses of {CASES} cases: {counts}; API RSS after {WARM_UP}: {warm:.0f} MiB, at the end: "
          f"{rss_mib(pid):.0f} MiB")
    assert sum(counts.values()) == CASES and counts.get(200, 0) > 500 and counts.get(400, 0) > 2000
    status, answer, _ = send(api, "POST", "/v1/completions", GOOD, auth)
    assert status == 200 and answer["choices"][0]["token_ids"] == before
    assert wait_until(lambda: idle(api), ANSWER_WAIT)
    assert api.server.proc.poll() is None and api_pids(api) == [pid] and api.server.worker_pids() == workers
    assert rss_mib(pid) < warm + 64
    assert "Traceback" not in api.server.output() and "Exception in ASGI" not in api.server.output()
