"""A client flooding the server with garbage neither starves other clients nor floods the server log."""

import asyncio
import re
import threading

import pytest
import zmq

from launch.client import AsyncEngineClient
from protocol import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from protocol.codec import client_codec, outputs_codec
from protocol.messages import EngineCoreGetStats
from tests.e2e.conftest import ServerProcess, wait_until
from tests.e2e.serve_support import SMALL, collect

PROMPT = [5, 17, 300, 42, 9]
GARBAGE = b"\xc1"  # a byte msgpack never uses
LIVENESS = 60.0  # seconds: a bound for what should happen soon, not a timing


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("flood"), SMALL)
    try:
        asyncio.run(server.wait_ready())
        yield server
    finally:
        server.stop()


class Flood(threading.Thread):
    """One raw client sending garbage as fast as the server takes it, until stopped."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address, self.sent, self.stopping = address, 0, threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDTIMEO, 100)  # so a full pipe still lets it notice stop()
        sock.connect(self.address)
        try:
            while not self.stopping.is_set():
                try:
                    sock.send(GARBAGE)
                    self.sent += 1
                except zmq.Again:
                    pass
        finally:
            sock.close(linger=0)
            ctx.term()

    def stop(self) -> None:
        self.stopping.set()
        self.join()


def test_a_good_client_is_served_while_another_floods_garbage(server):
    from tests.e2e.in_process import in_process_greedy
    from tests.e2e.serve_support import GREEDY

    expected = in_process_greedy([PROMPT], GREEDY)[0]
    flood = Flood(server.address)
    flood.start()
    try:
        assert wait_until(lambda: "Dropped a malformed client message" in server.output(), LIVENESS)

        async def good_client():
            async with AsyncEngineClient(server.address) as client:
                return await asyncio.wait_for(collect(client, PROMPT), LIVENESS)

        tokens, last = asyncio.run(good_client())
        sent_when_served = flood.sent
        assert wait_until(lambda: flood.sent > sent_when_served, LIVENESS), "the flood had stopped"
    finally:
        flood.stop()
    assert tokens == expected and last.finish_reason == "length"


def test_warnings_about_one_flooding_client_are_limited_and_the_rest_counted(server):
    floods, identity = 3000, b"flooding-client"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)  # the log names a client by its identity in hex
    try:
        sock.connect(server.address)
        for _ in range(floods):
            sock.send(GARBAGE)
        sock.send(client_codec().encode(EngineCoreGetStats()))  # answered after the garbage: one client, in order
        assert sock.poll(LIVENESS * 1000), "the server did not answer"
        reply: EngineCoreOutputs = outputs_codec().decode(sock.recv())
        assert reply.stats is not None
    finally:
        sock.close(linger=0)
        ctx.term()
    name = identity.hex()[:16]
    suppressed_line = re.compile(rf"Suppressed (\d+) warning\(s\) about client {name}")
    assert wait_until(lambda: suppressed_line.search(server.output()), LIVENESS), server.output()[-2000:]
    log = server.output()
    logged = len(re.findall(rf"Dropped a malformed client message.*\(client {name}\)", log))
    suppressed = sum(int(n) for n in suppressed_line.findall(log))
    assert logged <= 100 and logged + suppressed == floods, (logged, suppressed)


def test_warnings_about_requests_that_can_never_run_are_limited_per_client(server):
    """Well-formed requests the scheduler refuses (here: empty prompts) each get an error output, and the
    warnings about them are limited per client like those about garbage."""
    requests, identity = 300, b"refused-requests"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    codec, errors = client_codec(), []
    try:
        sock.connect(server.address)
        for i in range(requests):
            sock.send(codec.encode(EngineCoreRequest(f"empty-{i}", [], SamplingParams(max_tokens=4), 0.0)))
        while len(errors) < requests:
            assert sock.poll(LIVENESS * 1000), f"the server answered {len(errors)} of {requests} requests"
            reply: EngineCoreOutputs = outputs_codec().decode(sock.recv())
            errors += [out for out in reply.outputs if out.finish_reason == "error"]
    finally:
        sock.close(linger=0)
        ctx.term()
    assert all("prompt" in out.error for out in errors), errors[0].error
    name = identity.hex()[:16]
    assert wait_until(lambda: f"More than 10 warnings about client {name}" in server.output(), LIVENESS)
    assert len(re.findall(rf"Rejected request 'empty-\d+': .*\(client {name}\)", server.output())) == 10
