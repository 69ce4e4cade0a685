"""A handler that fails answers 500 in OpenAI's error shape, its traceback in the log and never in the body.

No route of the API fails on purpose, so this test serves the API's own application (create_app, with its
guard and error handlers, under its uvicorn server) with one more route that raises, in this process.
"""

import asyncio
import json
import logging
import threading

import pytest

from launch.api_server.app import create_app
from launch.api_server.connections import HttpConfig, HttpServer
from launch.api_server.state import Served
from launch.api_server.text_model import load_text_model
from launch.client import AsyncEngineClient
from tests.e2e.conftest import wait_until
from tests.e2e.http_support import error_of, raw_exchange
from tests.e2e.serve_support import free_port


def boom() -> None:
    raise RuntimeError("a secret detail of the failure")


@pytest.fixture
def server(tmp_path):
    engine = AsyncEngineClient(f"ipc://{tmp_path}/nobody.sock")  # never asked: the route below fails first
    served = Served(engine, load_text_model(None), "tiny", 256, "http://127.0.0.1:1/metrics")
    app = create_app(served)
    app.add_api_route("/boom", boom, methods=["GET"])
    port = free_port()
    http = HttpServer(HttpConfig(app, max_connections=8, header_timeout=10, host="127.0.0.1", port=port,
                                 log_level="warning"), served)
    log = Logged()
    logging.getLogger("uvicorn.error").addHandler(log)  # after the config, which sets uvicorn's loggers up
    thread = threading.Thread(target=lambda: asyncio.run(http.serve()))
    thread.start()
    try:
        assert wait_until(lambda: http.started, 60)
        yield port, log
    finally:
        http.should_exit = True
        thread.join()
        logging.getLogger("uvicorn.error").removeHandler(log)


class Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        return "\n".join(self.format(r) for r in self.records)


def test_a_failing_handler_answers_500_in_openais_shape_without_its_traceback(server):
    port, log = server
    answer = raw_exchange(port, b"GET /boom HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500 ") and b"content-type: application/json" in head.lower()
    error = error_of(json.loads(body))
    assert (error["code"], error["type"]) == (500, "InternalServerError")
    assert b"secret detail" not in body and b"Traceback" not in body
    # the log keeps what the client is not shown (written once the answer has left)
    assert wait_until(lambda: "secret detail" in log.text(), 60)
