"""API keys, the admin key, per-user limits and tenant isolation of the prefix cache, through a real server."""

import http.client
import json

import openai
import pytest

from tests.e2e.conftest import cmdline, processes_in_group
from tests.e2e.http_support import SMALL, error_of, send
from tests.e2e.openai_server import sse_events, start_api_server

KEYS = "key-a,key-b"
ROUTES = [("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
          ("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"}), ("POST", "/detokenize", {"tokens": [5]}),
          ("GET", "/metrics", None), ("GET", "/no/such/route", None)]
PROMPT_64 = list(range(3, 67))  # 4 blocks of 16: a repeat finds 48 tokens cached (the last one is always computed)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_but_health_and_version_needs_a_key_from_the_environment(start_server, monkeypatch):
    monkeypatch.setenv("KVENGINE_API_KEY", KEYS)  # as vLLM's VLLM_API_KEY: the key stays out of the process list
    api = start_api_server(start_server, *SMALL)
    for method, path, body in ROUTES:
        for headers in ({}, bearer("key-c"), bearer(""), {"Authorization": "Basic key-a"}):
            status, answer, response_headers = send(api, method, path, body, headers)
            assert (status, error_of(answer)["type"]) == (401, "AuthenticationError"), (path, headers)
            assert response_headers["www-authenticate"] == "Bearer"
        assert send(api, method, path, body, bearer("key-b"))[0] == (404 if path == "/no/such/route" else 200)
    for path in ("/health", "/version"):
        assert send(api, "GET", path)[0] == 200
    status, answer, _ = send(api, "POST", "/reset_prefix_cache", None, bearer("key-a"))
    assert status == 403 and "--admin-api-key" in error_of(answer)["message"]
    assert not [pid for pid in processes_in_group(api.server.proc.pid) if "key-a" in " ".join(cmdline(pid))]
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="key-a", max_retries=0)
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="nope", max_retries=0).models.list()


def test_reset_prefix_cache_takes_the_admin_key_and_no_api_key(start_server):
    api = start_api_server(start_server, *SMALL, "--api-key", "user-key", "--admin-api-key", "admin-key")
    assert send(api, "POST", "/reset_prefix_cache", None, bearer("user-key"))[0] == 401
    assert send(api, "POST", "/reset_prefix_cache")[0] == 401
    assert send(api, "POST", "/reset_prefix_cache", None, bearer("admin-key"))[0] == 200
    assert send(api, "GET", "/metrics", None, bearer("admin-key"))[0] == 200


def cached(api, headers: dict[str, str], **extra: object) -> int:
    status, answer, _ = send(api, "POST", "/v1/completions", {"prompt": PROMPT_64, "max_tokens": 2, **extra}, headers)
    assert status == 200, answer
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_keeps_a_tenants_prefixes_from_another(start_server):
    api = start_api_server(start_server, *SMALL)
    assert cached(api, {}, cache_salt="tenant-a") == 0
    assert cached(api, {}, cache_salt="tenant-b") == 0  # was 48: B learnt that A had sent this prompt
    assert cached(api, {}) == 0
    assert cached(api, {}, cache_salt="tenant-a") == 48


def test_cache_salt_per_api_key_isolates_keys_whatever_salt_they_send(start_server):
    api = start_api_server(start_server, *SMALL, "--api-key", KEYS, "--cache-salt-per-api-key")
    assert cached(api, bearer("key-a")) == 0
    assert cached(api, bearer("key-b")) == 0
    assert cached(api, bearer("key-a")) == 48
    assert cached(api, bearer("key-b"), cache_salt="x") == 0
    assert cached(api, bearer("key-b"), cache_salt="x") == 48


def test_a_user_past_its_limit_gets_429_while_another_user_is_served(start_server):
    api = start_api_server(start_server, "--max-model-len", "2048", "--kv-cache-memory-bytes", "16MiB",
                           "--api-key", KEYS, "--max-user-requests", "4")
    conn = http.client.HTTPConnection("127.0.0.1", api.port, timeout=300)
    body = {"prompt": [[5, 6, 7]] * 3, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", **bearer("key-a")})
    try:
        next(sse_events(conn.getresponse()))  # key-a now has 3 prompts in flight
        status, answer, _ = send(api, "POST", "/v1/completions", {"prompt": [[5], [6]], "max_tokens": 2},
                                 bearer("key-a"))
        assert (status, error_of(answer)["type"]) == (429, "RateLimitError")
        assert send(api, "POST", "/v1/completions", {"prompt": [5], "max_tokens": 2}, bearer("key-a"))[0] == 200
        assert send(api, "POST", "/v1/completions", {"prompt": [[5]] * 4, "max_tokens": 2}, bearer("key-b"))[0] == 200
        assert send(api, "POST", "/v1/completions", {"prompt": [[5]] * 5, "max_tokens": 2}, bearer("key-b"))[0] == 429
    finally:
        conn.close()
