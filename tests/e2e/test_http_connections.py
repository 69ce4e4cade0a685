"""Connection hygiene through a real server: idle, slowloris and short-bodied connections are closed or answered
within the configured timeouts while a good client is served throughout, and at shutdown every handler in
flight answers instead of being left for uvicorn to cancel."""

import http.client
import json
import os
import signal
import socket
import threading

from tests.e2e.conftest import wait_until
from tests.e2e.http_support import ANSWER_WAIT, SMALL, api_pids, closed_by_peer, error_of, idle, send, stats
from tests.e2e.openai_server import sse_events, start_api_server

GOOD = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WAIT)


def test_idle_slowloris_and_short_body_connections_end_while_a_good_client_is_served(start_server):
    api = start_api_server(start_server, *SMALL, "--http-header-timeout", "2", "--http-body-timeout", "2",
                           "--max-http-connections", "256")
    idle_socks = [connect(api.port) for _ in range(1000)]
    slow_socks = [connect(api.port) for _ in range(50)]
    for sock in slow_socks:
        sock.sendall(HEAD)  # headers that never end
    short = connect(api.port)
    short.sendall(HEAD + b"Content-Length: 100\r\n\r\n{")
    try:
        assert send(api, "POST", "/v1/completions", GOOD)[0] == 200  # past the cap: an idle connection made room

        def all_closed() -> bool:
            for sock in slow_socks:  # a slowloris client keeps sending a byte of its headers
                if not closed_by_peer(sock):
                    sock.setblocking(True)
                    sock.sendall(b"X")
            return all(closed_by_peer(s) for s in idle_socks + slow_socks)

        assert wait_until(all_closed, 120)
        short.setblocking(True)
        answer = b"".join(iter(lambda: short.recv(65536), b""))  # to the close: head and body may come apart
        assert answer.startswith(b"HTTP/1.1 408 ") and b"--http-body-timeout" in answer
        assert send(api, "POST", "/v1/completions", GOOD)[0] == 200
    finally:
        for sock in [*idle_socks, *slow_socks, short]:
            sock.close()
    assert "Traceback" not in api.server.output()


def test_at_shutdown_every_handler_in_flight_answers_and_none_is_cancelled(start_server):
    api = start_api_server(start_server, "--max-model-len", "2048", "--kv-cache-memory-bytes", "16MiB",
                           "--max-num-seqs", "2")  # the API process keeps 2 engine requests in flight
    long = {"prompt": [5, 6, 7], "max_tokens": 2000, "ignore_eos": True}
    stream = http.client.HTTPConnection("127.0.0.1", api.port, timeout=ANSWER_WAIT)
    stream.request("POST", "/v1/completions", json.dumps({**long, "stream": True}))
    events = sse_events(stream.getresponse())
    next(events)
    answers: list = []
    waiting = [threading.Thread(target=lambda: answers.append(send(api, "POST", "/v1/completions", long)))
               for _ in range(2)]  # one runs, one waits for a slot
    for thread in waiting:
        thread.start()
    assert wait_until(lambda: stats(api).num_running_reqs == 2, ANSWER_WAIT)
    [pid] = api_pids(api)
    os.kill(pid, signal.SIGTERM)
    last = [json.loads(e) for e in events if e != "[DONE]"][-1]
    for thread in waiting:
        thread.join()
    stream.close()
    assert error_of(last)["code"] == 503
    assert sorted(status for status, _, _ in answers) == [503, 503]
    assert all("shutting down" in error_of(answer)["message"] for _, answer, _ in answers)
    assert wait_until(lambda: not api_pids(api), ANSWER_WAIT)
    assert wait_until(lambda: idle(api), ANSWER_WAIT)  # the engine aborted what the API process had sent
    log = api.server.output()
    assert "Cancel" not in log and "Traceback" not in log and "Exception in ASGI" not in log, log
