"""Fuzz: over 10,000 malformed inputs on every socket of one running server, then it still serves the same tokens.

Sockets: the client ROUTER (random bytes, truncated requests, msgpack of wrong types and shapes, extra
frames, legacy ZMTP/1.0 and hand-made ZMTP/3.0 over a raw socket, oversized frames), the KV-events
replay ROUTER, the KV-events PUB and the metrics HTTP port. Generators are seeded: a failure reproduces.
"""

import asyncio
import math
import random
import socket
import struct
import time
import urllib.request
from collections import Counter

import msgspec
import zmq

from engine_core.client_router import MAX_CLIENT_FRAME_BYTES
from launch.client import AsyncEngineClient
from protocol import EngineCoreRequest, SamplingParams
from protocol.codec import client_codec, outputs_codec
from protocol.kv_events import END_SEQ
from tests.e2e.conftest import wait_until
from tests.e2e.serve_support import free_port, prompts

SEED = 20240611
PROMPT = prompts(1, seed=7, lo=40, hi=41)[0]  # 40 tokens: two full blocks, so it publishes KV events
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
REPLY_WAIT_MS = 60_000  # a liveness bound for a reply, not a timing
TAGS = ["EngineCoreRequest", "EngineCoreAbort", "EngineCoreGetStats", "EngineCoreResetPrefixCache", "EngineCoreGetInfo"]
INTS = [0, 1, -1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1]
FLOATS = [math.nan, math.inf, -math.inf, -0.0, 1e308, 0.5]


# ---- generators ---------------------------------------------------------------------------------


def request_fields(rng: random.Random, request_id: str) -> list:
    """A valid EngineCoreRequest as its msgpack array (a tiny one: if a mutation stays valid, it runs 2 tokens)."""
    prompt = [rng.randrange(1024) for _ in range(rng.randrange(1, 40))]
    return ["EngineCoreRequest", request_id, prompt, [2, 0.0], time.time()]


def value(rng: random.Random, depth: int = 0) -> object:
    """Any msgpack value: the wrong type for almost every field."""
    kind = rng.randrange(8 if depth < 3 else 6)
    if kind == 0:
        return None if rng.random() < 0.5 else rng.random() < 0.5
    if kind == 1:
        return rng.choice(INTS) if rng.random() < 0.5 else rng.randrange(-1000, 1000)
    if kind == 2:
        return rng.choice(FLOATS)
    if kind == 3:
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)])) for _ in range(rng.randrange(12)))
    if kind == 4:
        return rng.randbytes(rng.randrange(12))
    if kind == 5:
        return rng.choice(TAGS)
    if kind == 6:
        return [value(rng, depth + 1) for _ in range(rng.randrange(6))]
    return {rng.choice(["type", "request_id", "x", 1]): value(rng, depth + 1) for _ in range(rng.randrange(4))}


def wrong_typed(rng: random.Random, n: int) -> bytes:
    """Valid msgpack, wrong for the protocol: a bare value, a tag with random fields, or one field replaced."""
    kind = rng.randrange(4)
    if kind == 0:
        message = value(rng)
    elif kind == 1:
        message = [rng.choice(TAGS), *(value(rng) for _ in range(rng.randrange(7)))]
    elif kind == 2:
        message = request_fields(rng, f"fuzz-{n}")
        message[rng.randrange(1, len(message))] = value(rng)
    else:
        message = {"type": rng.choice(TAGS), "request_id": value(rng), "prompt_token_ids": value(rng)}
    return msgspec.msgpack.encode(message)


def truncated(rng: random.Random, n: int) -> bytes:
    data = msgspec.msgpack.encode(request_fields(rng, f"fuzz-{n}"))
    return data[: rng.randrange(len(data))]


def client_frame(rng: random.Random, n: int) -> list[bytes]:
    """One malformed client message: its frames."""
    kind = rng.randrange(4)
    if kind == 0:
        return [rng.randbytes(rng.randrange(80))]
    if kind == 1:
        return [truncated(rng, n)]
    if kind == 2:
        return [wrong_typed(rng, n)]
    return [rng.randbytes(rng.randrange(20)) for _ in range(rng.randrange(2, 5))]  # a frame too many


def legacy_message(rng: random.Random, n: int) -> bytes:
    """Frames in ZMTP/1.0 framing: length (of flags + body), flags, body; 0xFF and 8 bytes for a long one."""
    frames = client_frame(rng, n)
    out = b""
    for i, body in enumerate(frames):
        more = 1 if i < len(frames) - 1 else 0
        size = len(body) + 1
        out += (bytes([size]) if size < 255 else b"\xff" + struct.pack(">Q", size)) + bytes([more]) + body
    return out


ZMTP3_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)
ZMTP3_READY = b"\x04" + bytes([6 + 1 + 11 + 4 + 6]) + b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"


def raw_client_bytes(rng: random.Random, n: int) -> tuple[bytes, int]:
    """What one raw connection to a ZeroMQ socket sends, and how many messages that is."""
    kind = rng.randrange(4)
    if kind == 0:  # ZMTP/1.0: an identity (random, maybe reserved), then a few messages
        identity = rng.randbytes(rng.randrange(3))
        count = rng.randrange(1, 6)
        head = bytes([len(identity) + 1, 0]) + identity
        return head + b"".join(legacy_message(rng, n * 10 + i) for i in range(count)), count
    if kind == 1:  # ZMTP/3.0 that declares a frame of 2**62 bytes and sends none of it
        return ZMTP3_GREETING + ZMTP3_READY + b"\x02" + struct.pack(">Q", 2**62), 1
    if kind == 2:  # ZMTP/3.0 handshake, then random frames
        frames = b"".join(bytes([rng.choice([0, 1])]) + bytes([k]) + rng.randbytes(k) for k in range(rng.randrange(1, 5)))
        return ZMTP3_GREETING + ZMTP3_READY + frames, 1
    return rng.choice([b"", b"\xff"]) + rng.randbytes(rng.randrange(1, 200)), 1  # no protocol at all


def replay_request(rng: random.Random) -> list[bytes]:
    """A malformed replay request (wrong frame count, delimiter or seq length), now and then a valid one."""
    kind = rng.randrange(5)
    if kind == 0:
        return [rng.randbytes(rng.randrange(12)) for _ in range(rng.randrange(1, 5))]
    if kind == 1:
        return [b"", rng.randbytes(rng.choice([0, 7, 9, 100]))]
    if kind == 2:
        return [rng.randbytes(rng.randrange(1, 4)), rng.randbytes(8)]
    if kind == 3:
        return [b"", rng.randbytes(8), b""]
    return [b"", rng.randbytes(8)]  # valid: replays from a random seq (mostly far past the end)


def http_request(rng: random.Random) -> tuple[bytes, bool]:
    """Garbage for the metrics port; True if it is a complete head that must get an HTTP answer."""
    text = "".join(chr(rng.randrange(32, 256)) for _ in range(rng.randrange(40)))
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(200)), False  # raw bytes, no end of head (unless by chance)
    if kind == 1:
        return text.encode("latin-1") + b"\r\n\r\n", True  # no valid request line
    if kind == 2:
        method = rng.choice(["GET", "POST", "OPTIONS", "DELETE", text.replace(" ", "")])
        path = rng.choice(["/metrics", "/favicon.ico", "/", "/metrics?name[]=" + text.replace(" ", ""), "*"])
        return f"{method} {path} HTTP/1.{rng.randrange(3)}\r\n\r\n".encode("latin-1"), True
    if kind == 3:
        accept = rng.choice(["text/plain; version=", "application/openmetrics-text; version=", "text/plain", ""])
        accept += rng.choice(["1.0.0", "0.0.4", "abc", "", "2", "1.0.0; escaping=" + text.replace(",", "")])
        headers = f"Accept: {accept}\r\nAccept-Encoding: {rng.choice(['gzip', 'br', text])}\r\n{text}: x\r\n"
        return f"GET /metrics HTTP/1.1\r\n{headers}\r\n".encode("latin-1"), True
    if kind == 4:
        return b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n", False  # head over the limit
    return f"GET /metrics HTTP/1.1\r\n{text}".encode("latin-1"), False  # cut off mid-head


# ---- senders ------------------------------------------------------------------------------------


def dealer_flood(ctx: zmq.Context, address: str, messages: list[list[bytes]], sentinel: bytes, sentinel_id: str) -> None:
    """Send every message on a fresh DEALER, then the sentinel; once its answer comes, all were read."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        for frames in messages:
            sock.send_multipart(frames)
        sock.send(sentinel)
        codec = outputs_codec()
        while True:
            assert sock.poll(REPLY_WAIT_MS), "the server stopped answering"
            if any(out.request_id == sentinel_id for out in codec.decode(sock.recv()).outputs):
                return
    finally:
        sock.close()


def raw_send(family: int, address: object, data: bytes) -> None:
    with socket.socket(family, socket.SOCK_STREAM) as raw:
        raw.connect(address)
        raw.sendall(data)


def http_exchange(port: int, data: bytes, answered: bool) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(data)
        if answered:
            conn.settimeout(REPLY_WAIT_MS / 1000)
            reply = b""
            while len(reply) < 9 and (chunk := conn.recv(16)):
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 "), f"no HTTP answer to {data[:200]!r}: {reply!r}"


def fuzz_client_socket(ctx: zmq.Context, address: str, rng: random.Random, counts: Counter) -> None:
    ipc_path = address.removeprefix("ipc://")
    n = 0
    for batch in range(14):  # batches under the high-water mark: the answers are never dropped
        messages = [client_frame(rng, n + i) for i in range(500)]
        n += len(messages)
        sentinel_id = f"sentinel-{batch}"
        sentinel = msgspec.msgpack.encode(["EngineCoreRequest", sentinel_id, [1], [0], 0.0])  # max_tokens 0: refused
        dealer_flood(ctx, address, messages, sentinel, sentinel_id)
        counts["client ROUTER", "DEALER messages"] += len(messages)
    for i in range(300):
        data, messages = raw_client_bytes(rng, i)
        raw_send(socket.AF_UNIX, ipc_path, data)
        counts["client ROUTER", "raw ZMTP/1.0, ZMTP/3.0, garbage"] += messages
    for _ in range(3):
        sock = ctx.socket(zmq.DEALER)
        sock.connect(address)
        sock.send(b"\x00" * (MAX_CLIENT_FRAME_BYTES + 1))
        sock.close(linger=-1)  # delivered before ctx.term() returns
        counts["client ROUTER", "oversized"] += 1


def fuzz_replay_socket(ctx: zmq.Context, address: str, rng: random.Random, counts: Counter) -> None:
    for _ in range(4):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, -1)
        sock.connect(address)
        for _ in range(500):
            sock.send_multipart(replay_request(rng))
            counts["replay ROUTER", "DEALER messages"] += 1
        sock.close()
    for i in range(100):
        data, messages = raw_client_bytes(rng, i)
        raw_send(socket.AF_UNIX, address.removeprefix("ipc://"), data)
        counts["replay ROUTER", "raw"] += messages


def fuzz_pub_socket(ctx: zmq.Context, address: str, rng: random.Random, counts: Counter) -> None:
    sock = ctx.socket(zmq.XSUB)  # subscription frames are the only thing a PUB reads
    sock.setsockopt(zmq.LINGER, -1)
    sock.connect(address)
    for _ in range(500):
        sock.send(rng.choice([b"", b"\x00", b"\x01", b"\x02"]) + rng.randbytes(rng.randrange(30)))
        counts["events PUB", "XSUB subscriptions"] += 1
    sock.close()
    for i in range(100):
        data, messages = raw_client_bytes(rng, i)
        raw_send(socket.AF_UNIX, address.removeprefix("ipc://"), data)
        counts["events PUB", "raw"] += messages


def fuzz_metrics_port(port: int, rng: random.Random, counts: Counter) -> None:
    for _ in range(700):
        data, answered = http_request(rng)
        http_exchange(port, data, answered)
        counts["metrics HTTP", "connections"] += 1


# ---- checks -------------------------------------------------------------------------------------


async def good_request(address: str) -> list[int]:
    async with AsyncEngineClient(address) as client:
        tokens, last = [], None
        async for out in client.generate(PROMPT, GREEDY):
            tokens += out.new_token_ids
            last = out
    assert last is not None and last.finish_reason == "length", last
    return tokens


async def stats(address: str):
    async with AsyncEngineClient(address) as client:
        return await client.get_stats()


def replay_all(ctx: zmq.Context, address: str) -> list[list[bytes]]:
    """A valid replay request from seq 0: every buffered batch, up to the end marker."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = []
        while True:
            assert sock.poll(REPLY_WAIT_MS), "the replay socket stopped answering"
            frames = sock.recv_multipart()
            if frames[2] == END_SEQ:
                return replies
            replies.append(frames)
    finally:
        sock.close()


def scrape_running(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    [line] = [line for line in text.splitlines() if line.startswith("kvengine:num_requests_running ")]
    return float(line.split()[1])


def test_ten_thousand_malformed_inputs_on_every_socket_leave_the_server_serving(start_server, tmp_path):
    port = free_port()
    events, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/rp"
    server = start_server("--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB", "--metrics-port", str(port),
                          "--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay)
    asyncio.run(server.wait_ready())
    expected = asyncio.run(good_request(server.address))
    idle = asyncio.run(stats(server.address))

    rng = random.Random(SEED)
    counts: Counter = Counter()
    ctx = zmq.Context()
    try:
        fuzz_client_socket(ctx, server.address, rng, counts)
        fuzz_replay_socket(ctx, replay, rng, counts)
        fuzz_pub_socket(ctx, events, rng, counts)
        fuzz_metrics_port(port, rng, counts)
        assert server.proc.poll() is None, server.output()[-3000:]

        assert asyncio.run(good_request(server.address)) == expected
        assert replay_all(ctx, replay), "the batches of the first request are no longer replayed"
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(events)
        seeds = iter(range(100, 10_000))

        def published() -> bool:  # a fresh prompt per try stores new blocks, until the late subscriber has joined
            asyncio.run(good_request_with(server.address, prompts(1, seed=next(seeds), lo=40, hi=41)[0]))
            return sub.poll(100) != 0

        try:
            assert wait_until(published), "the PUB socket no longer publishes"
            assert len(sub.recv_multipart()) == 3
        finally:
            sub.close()
    finally:
        ctx.term()

    def back_to_idle() -> bool:
        now = asyncio.run(stats(server.address))
        return (now.num_running_reqs, now.num_waiting_reqs, now.num_blocks_held, now.num_free_blocks) == (
            0, 0, 0, idle.num_free_blocks)

    assert wait_until(back_to_idle), asyncio.run(stats(server.address))
    assert wait_until(lambda: scrape_running(port) == 0)  # the gauges follow the stats a period later
    assert server.proc.poll() is None
    assert "Traceback" not in server.output(), server.output()[-3000:]
    for (where, kind), count in sorted(counts.items()):
        print(f"{where:14} {kind:34} {count:6}")
    print(f"{'total':49} {sum(counts.values()):6}")
    assert sum(counts.values()) >= 10_000
    assert {where for where, _ in counts} == {"client ROUTER", "replay ROUTER", "events PUB", "metrics HTTP"}


async def good_request_with(address: str, prompt: list[int]) -> None:
    async with AsyncEngineClient(address) as client:
        async for _ in client.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True)):
            pass


def test_the_generators_make_what_they_claim():
    """Truncated requests never decode; the ZMTP/3.0 handshake is well formed."""
    rng = random.Random(SEED)
    codec = client_codec()
    for n in range(200):
        try:
            codec.decode(truncated(rng, n))
        except ValueError:
            continue
        raise AssertionError("a truncated request decoded")
    assert len(ZMTP3_GREETING) == 64 and ZMTP3_READY[1] == len(ZMTP3_READY) - 2
    valid = msgspec.msgpack.encode(request_fields(rng, "ok"))
    assert isinstance(codec.decode(valid), EngineCoreRequest)
