"""End-to-end: hand-built requests that bypass the client's own checks get an error output, never a crash.

One real server serves the whole module; every test ends by checking that it still serves correct tokens.
"""

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from engine_core.client_router import MAX_CLIENT_FRAME_BYTES, MAX_ERROR_CHARS
from launch.client import AsyncEngineClient
from protocol import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from protocol.codec import client_codec, outputs_codec
from protocol.messages import EngineCoreGetStats
from tests.e2e.conftest import ServerProcess
from tests.e2e.serve_support import GREEDY, SMALL, collect

PROMPT = [5, 17, 300, 42, 9]
REPLY_WAIT_MS = 60_000  # a liveness bound for a reply, not a timing


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = ServerProcess(tmp_path_factory.mktemp("hostile"), SMALL)
    try:
        asyncio.run(server.wait_ready())
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def expected_tokens() -> list[int]:
    from tests.e2e.in_process import in_process_greedy

    return in_process_greedy([PROMPT], GREEDY)[0]


def forged(request_id: str, sampling: list, prompt: list[int] = PROMPT) -> bytes:
    """An EngineCoreRequest as msgpack, SamplingParams in field order: nothing checks it before the server."""
    return msgspec.msgpack.encode(["EngineCoreRequest", request_id, prompt, sampling, time.time()])


async def send_raw(address: str, *frames: bytes, replies: int | None = None) -> list[EngineCoreOutputs]:
    """Send frames on a fresh DEALER socket; return the replies (by default one per frame), in order."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.connect(address)
        for frame in frames:
            await sock.send(frame)
        received = []
        for _ in range(len(frames) if replies is None else replies):
            assert await sock.poll(REPLY_WAIT_MS), "the server did not answer"
            received.append(outputs_codec().decode(await sock.recv()))
        return received
    finally:
        sock.close(linger=0)
        ctx.term()


def one_error(reply: EngineCoreOutputs, request_id: str) -> str:
    [out] = reply.outputs
    assert (out.request_id, out.new_token_ids, out.finish_reason) == (request_id, [], "error")
    assert out.error is not None and len(out.error) <= MAX_ERROR_CHARS
    return out.error


async def normal_tokens(address: str) -> list[int]:
    async with AsyncEngineClient(address) as client:
        tokens, last = await collect(client, PROMPT)
    assert last.finish_reason == "length"
    return tokens


HOSTILE = [
    ("huge-top-k", [16, 1.0, 2**63], "top_k must be in [0, 2147483647], got 9223372036854775808"),
    ("huge-top-k-uint64", [16, 1.0, 2**64 - 1], "top_k must be in [0, 2147483647]"),
    ("nan-temperature", [16, float("nan")], "temperature must be in [0.0, 100.0], got nan"),
    ("inf-temperature", [16, float("inf")], "temperature must be in [0.0, 100.0], got inf"),
    ("zero-max-tokens", [0], "max_tokens must be in [1, 2147483647], got 0"),
    ("huge-max-tokens", [2**63], "max_tokens must be in [1, 2147483647]"),
    ("huge-seed", [16, 1.0, 0, 1.0, 2**64 - 1], "seed must be in"),
    ("huge-stop-id", [16, 1.0, 0, 1.0, None, [2**63]], "stop_token_ids entries must be in [0, 2147483647]"),
]


@pytest.mark.parametrize("request_id,sampling,message", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_out_of_range_value_gets_an_error_output_and_the_server_keeps_serving(
    server, expected_tokens, request_id, sampling, message
):
    [reply] = asyncio.run(send_raw(server.address, forged(request_id, sampling)))
    assert message in one_error(reply, request_id)
    assert asyncio.run(normal_tokens(server.address)) == expected_tokens


def test_two_million_stop_ids_are_refused_while_a_normal_request_runs_alongside(server, expected_tokens):
    hostile = forged("many-stops", [400, 1.0, 0, 1.0, None, [7] * 2_000_000])

    async def scenario():
        async with AsyncEngineClient(server.address) as client:
            normal = asyncio.create_task(collect(client, PROMPT))
            [reply] = await send_raw(server.address, hostile)
            tokens, last = await normal
        return reply, tokens, last

    reply, tokens, last = asyncio.run(scenario())
    assert "length <= 1024" in one_error(reply, "many-stops")
    assert tokens == expected_tokens and last.finish_reason == "length"


def test_a_300_character_request_id_is_answered_with_the_limit(server, expected_tokens):
    request_id = "r" * 300
    [reply] = asyncio.run(send_raw(server.address, forged(request_id, [])))
    assert "request_id has 300 characters, more than 256" in one_error(reply, request_id)
    with pytest.raises(ValueError, match="more than 256"):  # the client library refuses it before sending
        EngineCoreRequest(request_id, PROMPT, SamplingParams(), 0.0)
    assert asyncio.run(normal_tokens(server.address)) == expected_tokens


def test_an_id_too_long_to_echo_is_dropped_without_an_answer(server, expected_tokens):
    """Messages of one client are handled in order, so the first reply being the stats means no error output."""
    stats = client_codec().encode(EngineCoreGetStats())
    [reply] = asyncio.run(send_raw(server.address, forged("x" * 100_000, [0]), stats, replies=1))
    assert reply.stats is not None and reply.outputs == []
    log = server.output()
    assert "Dropped a malformed client message" in log and "x" * 1000 not in log
    assert asyncio.run(normal_tokens(server.address)) == expected_tokens


def test_a_frame_over_the_size_cap_disconnects_its_sender_and_the_server_keeps_serving(server, expected_tokens):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock.connect(server.address)
        sock.send(b"\x00" * (MAX_CLIENT_FRAME_BYTES + 1))
        assert monitor.poll(REPLY_WAIT_MS), "the server kept the connection"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()
    assert asyncio.run(normal_tokens(server.address)) == expected_tokens


def test_a_newline_in_a_request_id_cannot_forge_a_log_line(server, expected_tokens):
    request_id = "evil\nERROR forged: all requests leaked"
    invalid_values, empty_prompt = forged(request_id, [0]), forged(request_id, [], prompt=[])
    replies = asyncio.run(send_raw(server.address, invalid_values, empty_prompt))
    assert "max_tokens must be in" in one_error(replies[0], request_id)  # refused on decode, by the router
    assert "the prompt is empty" in one_error(replies[1], request_id)  # refused by the scheduler
    log = server.output()
    assert log.count(repr(request_id)) == 2, log
    assert "\nERROR forged" not in log
    assert asyncio.run(normal_tokens(server.address)) == expected_tokens
