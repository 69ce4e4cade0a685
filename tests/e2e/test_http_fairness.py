"""Fairness between HTTP users through a real server: prompts per request are capped, a user's prompts count
against its own limit, and one user's thousand prompts neither lock another user out nor make the engine drop
a reply (the API process never sends the engine more than it admits from one client)."""

import threading

from tests.e2e.conftest import wait_until
from tests.e2e.http_support import ANSWER_WAIT, SMALL, error_of, idle, send, stats
from tests.e2e.openai_server import start_api_server


def batch(count: int) -> dict:
    return {"prompt": [[9, 10, 11, 3 + i % 200] for i in range(count)], "max_tokens": 16, "ignore_eos": True}


def test_a_request_of_10000_prompts_is_refused_by_name_and_the_engine_never_sees_it(start_server):
    api = start_api_server(start_server, *SMALL)
    status, answer, _ = send(api, "POST", "/v1/completions", batch(10_000))
    error = error_of(answer)
    assert status == 400 and error["param"] == "prompt" and "at most 1024 prompts" in error["message"]
    assert stats(api).num_prompt_tokens == 0 and idle(api)
    assert "Dropped a reply" not in api.server.output()


def test_while_one_user_runs_1024_prompts_another_users_request_is_admitted_and_finishes(start_server):
    api = start_api_server(start_server, *SMALL)
    answers: list = []
    big = threading.Thread(target=lambda: answers.append(send(api, "POST", "/v1/completions", batch(1024))))
    big.start()
    try:
        assert wait_until(lambda: stats(api).num_running_reqs > 0, ANSWER_WAIT)
        status, answer, _ = send(api, "POST", "/v1/completions",
                                 {"prompt": [7, 8, 9], "max_tokens": 16, "ignore_eos": True})
        assert status == 200, answer  # was 503: "this client has 1024 requests in flight"
        assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 16
    finally:
        big.join()
    status, answer, _ = answers[0]
    assert status == 200 and len(answer["choices"]) == 1024
    assert {c["finish_reason"] for c in answer["choices"]} == {"length"}
    assert wait_until(lambda: idle(api), ANSWER_WAIT)
    assert "Dropped a reply" not in api.server.output() and "overloaded" not in api.server.output()
