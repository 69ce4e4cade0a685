"""A client process for test_hardening_client_close: it kills (or stops) its server at a seeded point.

Several AsyncEngineClients on one server run one phase: "close_idle" (they close), "close" (each closes
with a stream and a stats call in flight), "generate" (each streams a request) or "get_stats" (each asks
for stats in a loop).
The point is the N-th line Python runs during the phase (sys.settrace), N drawn from the seed within the
line count of a first run of the same phase that kills nothing. Then every client is asked again for
stats, a stream, an abort and a prefix-cache reset, and closed. It prints one JSON object: each call's
outcome, "ok", "EngineDeadError" or another exception's repr. SIGUSR1 dumps every thread's stack,
SIGUSR2 every asyncio task's.

    python -m tests.e2e.client_under_kill '{"address": ..., "pid": ..., "phase": ..., "seed": ..., "signal": ...}'

With phase "abandon" it kills nothing: a client with a stream in flight is left open when its event loop
ends, and the garbage collector must then free it (it reports {"collected": true}).
"""

import asyncio
import faulthandler
import gc
import json
import os
import random
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import FrameType
from typing import Any

from launch.client import AsyncEngineClient, EngineDeadError
from protocol import SamplingParams

CLIENTS = 4
PROMPT = [5, 17, 300, 42, 9]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SETTLE_S = 0.1  # after the kill, the clients' I/O threads see the connection drop while the phase's calls run


def process_state(pid: int) -> str:
    """R, S, T (stopped), Z (dead, not yet reaped) ...; "gone" once reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


class KillPoint:
    """A trace function that counts lines and sends the signal at line `at` (None: only count)."""

    def __init__(self, pid: int, signum: int, at: int | None) -> None:
        self.pid, self.signum, self.at = pid, signum, at
        self.lines = 0
        self.fired_at: int | None = None

    def __call__(self, frame: FrameType, event: str, arg: object) -> "KillPoint":
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.fire()
        return self

    def fire(self) -> None:
        self.fired_at = self.lines
        os.kill(self.pid, self.signum)
        while process_state(self.pid) not in ("T", "Z", "gone"):
            time.sleep(0.01)
        time.sleep(SETTLE_S)


async def outcome(call: Awaitable[Any]) -> str:
    try:
        await call
    except EngineDeadError:
        return "EngineDeadError"
    except Exception as e:  # noqa: BLE001  (any other failure is reported for the test to name)
        return repr(e)
    return "ok"


async def stream(client: AsyncEngineClient) -> None:
    async for _ in client.generate(PROMPT, PARAMS):
        pass


async def stats_loop(client: AsyncEngineClient) -> None:
    for _ in range(4):
        await client.get_stats()


async def phase_close_idle(clients: list[AsyncEngineClient]) -> list[str]:
    return [f"close: {r}" for r in await asyncio.gather(*(outcome(c.close()) for c in clients))]


async def phase_close(clients: list[AsyncEngineClient]) -> list[str]:
    streams = [asyncio.ensure_future(outcome(stream(c))) for c in clients]
    stats = [asyncio.ensure_future(outcome(c.get_stats())) for c in clients]
    await asyncio.sleep(0)  # both are sent and wait for their answers
    closes = await asyncio.gather(*(outcome(c.close()) for c in clients))
    return [f"close: {r}" for r in closes] + list(await asyncio.gather(*streams, *stats))


async def phase_generate(clients: list[AsyncEngineClient]) -> list[str]:
    return list(await asyncio.gather(*(outcome(stream(c)) for c in clients)))


async def phase_get_stats(clients: list[AsyncEngineClient]) -> list[str]:
    return list(await asyncio.gather(*(outcome(stats_loop(c)) for c in clients)))


PHASES: dict[str, Callable[[list[AsyncEngineClient]], Awaitable[list[str]]]] = {
    "close_idle": phase_close_idle, "close": phase_close, "generate": phase_generate, "get_stats": phase_get_stats}


async def run_phase(args: dict, tracer: KillPoint) -> tuple[list[AsyncEngineClient], list[str]]:
    options = {"heartbeat_timeout": args["heartbeat_timeout"]} if args["heartbeat_timeout"] else {}
    clients = [AsyncEngineClient(args["address"], **options) for _ in range(CLIENTS)]
    for client in clients:
        await client.start()
        await client.wait_ready()
    sys.settrace(tracer)
    try:
        return clients, await PHASES[args["phase"]](clients)
    finally:
        sys.settrace(None)


async def after_death(client: AsyncEngineClient) -> list[str]:
    """Stats first: once it fails the client knows, and every later call fails at once."""
    return [await outcome(client.get_stats()), await outcome(stream(client)), await outcome(client.abort("x")),
            await outcome(client.reset_prefix_cache()), f"close: {await outcome(client.close())}"]


def dump_tasks() -> None:
    for task in asyncio.all_tasks():
        task.print_stack(file=sys.stderr)


async def leave_open(address: str) -> None:
    client = AsyncEngineClient(address)
    await client.start()
    await client.generate(PROMPT, PARAMS).__anext__()


def abandon(args: dict) -> dict:
    asyncio.run(leave_open(args["address"]))
    gc.collect()
    return {"collected": True}


async def main(args: dict) -> dict:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, dump_tasks)
    signum = signal.Signals[args["signal"]]
    counter = KillPoint(args["pid"], signum, None)
    clients, _ = await run_phase(args, counter)
    for client in clients:
        await client.close()
    point = KillPoint(args["pid"], signum, random.Random(args["seed"]).randrange(1, counter.lines + 1))
    clients, during = await run_phase(args, point)
    if point.fired_at is None:
        point.fire()
    after = [await after_death(client) for client in clients]
    return {"lines": counter.lines, "at": point.at, "fired_at": point.fired_at, "during": during, "after": after}


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    arguments = json.loads(sys.argv[1])
    print(json.dumps(abandon(arguments) if arguments["phase"] == "abandon" else asyncio.run(main(arguments))))
