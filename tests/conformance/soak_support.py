"""The soak's load: mixed requests with aborts, vanishing clients and preemption for a while, then every request
accounted for (test_soak.py runs it against a server of its own).

Each request ends as one of:
  finished  a finish output ("length" or "stop")
  aborted   by its client on purpose: it left the stream early, or called abort() and got the "abort" output
  vanished  its client closed its socket mid-stream (the server must abort it on the disconnect)
  lost      it ended without a finish output, with an "error" output or an exception
  hung      no end within hang_bound seconds after the load (a liveness bound, not a timing)
Greedy requests of the same prompt must get the same tokens (float32).
"""

import asyncio
import random
import time
import uuid
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path

from launch.client import AsyncEngineClient
from launch.commands.local_server import LocalServer
from protocol import SamplingParams, SchedulerStats
from protocol.config import engine_config

OUTCOMES = ("finished", "aborted", "vanished", "lost", "hung")


@dataclass(frozen=True)
class SoakSettings:
    duration: float = 60.0  # seconds of load
    clients: int = 6  # concurrent client loops
    kv_cache_memory_bytes: int = 2 << 20  # small: requests get preempted
    max_model_len: int = 256
    dtype: str = "float32"  # greedy tokens of a prompt must not depend on batching or preemption
    hang_bound: float = 120.0  # seconds a request may still take after the load
    seed: int = 0


class Soak:
    def __init__(self, args: SoakSettings, address: str) -> None:
        self.args, self.address = args, address
        rng = random.Random(args.seed)
        # A fixed pool of prompts, each with its own max_tokens: greedy tokens of a prompt must always agree.
        self.prompts = []
        for _ in range(32):
            prompt = [rng.randrange(1024) for _ in range(rng.randrange(8, args.max_model_len // 2))]
            self.prompts.append((prompt, rng.randrange(4, args.max_model_len - len(prompt))))
        self.expected: dict[int, list[int]] = {}
        self.mismatches = 0
        self.requests: list[asyncio.Task] = []
        self.errors: list[str] = []

    async def one_request(self, client: AsyncEngineClient, rng: random.Random, mode: str, vanished: list[bool]) -> str:
        """Run one request in the given mode ("finish", "break" or "abort"); return its outcome."""
        index = rng.randrange(len(self.prompts))
        prompt, max_tokens = self.prompts[index]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        request_id = uuid.uuid4().hex
        stop_after = rng.randrange(1, max_tokens + 1)
        tokens: list[int] = []
        abort_sent = False
        try:
            async for out in client.generate(prompt, params, request_id=request_id):
                tokens += out.new_token_ids
                if out.finish_reason in ("length", "stop"):
                    self.check_tokens(index, tokens, max_tokens)
                    return "finished"
                if out.finish_reason == "abort" and abort_sent:
                    return "aborted"
                if out.finished:
                    self.errors.append(f"{request_id}: finish_reason {out.finish_reason}, error {out.error}")
                    return "lost"
                if len(tokens) >= stop_after and mode == "break":
                    return "aborted"  # leaving the stream aborts the request
                if len(tokens) >= stop_after and mode == "abort" and not abort_sent:
                    await client.abort(request_id)
                    abort_sent = True
        except asyncio.CancelledError:
            if vanished[0]:
                return "vanished"
            raise  # cancelled as hung
        except Exception as e:  # noqa: BLE001 -- any failure of a request is a lost request, reported below
            if vanished[0]:
                return "vanished"
            self.errors.append(f"{request_id}: {type(e).__name__}: {e}")
            return "lost"
        self.errors.append(f"{request_id}: the stream ended without a finish output")
        return "lost"

    def check_tokens(self, index: int, tokens: list[int], max_tokens: int) -> None:
        if len(tokens) != max_tokens:
            return
        if self.expected.setdefault(index, tokens) != tokens:
            self.mismatches += 1

    def spawn(self, coro: Coroutine[object, object, str]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self.requests.append(task)
        return task

    async def session(self, rng: random.Random, deadline: float) -> None:
        """One client: a few rounds of concurrent requests; a quarter of the clients vanish mid-stream."""
        client = AsyncEngineClient(self.address)
        await client.start()
        vanished = [False]
        if rng.random() < 0.25:
            tasks = [self.spawn(self.one_request(client, rng, "finish", vanished)) for _ in range(rng.randrange(1, 5))]
            await asyncio.wait(tasks, timeout=rng.uniform(0.1, 2.0))
            vanished[0] = True
            await client.close()  # the socket goes first: no abort is sent, the server sees a disconnect
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)
            return
        try:
            for _ in range(rng.randrange(1, 4)):
                if time.monotonic() >= deadline:
                    break
                modes = rng.choices(["finish", "break", "abort"], weights=[6, 2, 2], k=rng.randrange(1, 4))
                await asyncio.wait([self.spawn(self.one_request(client, rng, mode, vanished)) for mode in modes])
        finally:
            await client.close()

    async def client_loop(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            await self.session(rng, deadline)

    async def run(self) -> float:
        start = time.monotonic()
        deadline = start + self.args.duration
        loops = [asyncio.create_task(self.client_loop(self.args.seed * 1000 + i, deadline))
                 for i in range(self.args.clients)]
        await asyncio.wait(loops, timeout=max(0.0, deadline - time.monotonic()))
        # The load is over: whatever has not ended within the bound is hung.
        await asyncio.wait(loops + self.requests, timeout=self.args.hang_bound)
        for task in loops + self.requests:
            task.cancel()
        await asyncio.gather(*loops, *self.requests, return_exceptions=True)
        return time.monotonic() - start

    def outcomes(self) -> Counter:
        return Counter("hung" if task.cancelled() else task.result() for task in self.requests)


# ---- the server's processes ---------------------------------------------------------------------------------------


def group_processes(pgid: int) -> dict[int, str]:
    """pid -> role ("engine core", "worker rank N") of the live processes in the server's process group."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            args = (stat.parent / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError):
            continue
        pid = int(stat.parent.name)
        if fields[0] == "Z" or int(fields[2]) != pgid:
            continue
        if "worker.main" in args:
            config = args[args.index("worker.main") + 1]
            out[pid] = "worker rank " + config.split('"rank":')[1].split(",")[0]
        elif pid == pgid:
            out[pid] = "engine core"
    return out


def rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    kib = next((line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")), None)
    return int(kib) / 1024 if kib is not None else None


async def wait_idle(client: AsyncEngineClient, total_free: int, bound: float = 60.0) -> SchedulerStats:
    """The stats once the pool is back to idle, or the last ones after `bound` seconds (aborts take a step)."""
    end = time.monotonic() + bound
    while True:
        stats = await client.get_stats()
        idle = (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_blocks_held) == (0, 0, 0)
        if (idle and stats.num_free_blocks == total_free) or time.monotonic() > end:
            return stats
        await asyncio.sleep(0.2)


# ---- the run ------------------------------------------------------------------------------------------------


@dataclass
class SoakResult:
    elapsed: float
    requests: int
    outcomes: Counter
    mismatches: int  # greedy requests of one prompt that got other tokens
    errors: list[str]
    before: SchedulerStats  # after the warm-up
    after: SchedulerStats  # once back to idle (or the last stats, if it never got there)
    alive: bool
    rss_mib: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)  # process: start, end

    def idle(self) -> bool:
        a = self.after
        total = self.before.num_free_blocks + self.before.num_blocks_held
        return (a.num_running_reqs, a.num_waiting_reqs, a.num_blocks_held, a.num_free_blocks) == (0, 0, 0, total)

    def figures(self) -> list[str]:
        a = self.after
        counts = ", ".join(f"{o} {self.outcomes[o]}" for o in OUTCOMES)
        pool = (f"free {a.num_free_blocks}, held {a.num_blocks_held}, cached-free {a.num_cached_free_blocks}, "
                f"running {a.num_running_reqs}, waiting {a.num_waiting_reqs}")
        preemptions = a.num_preemptions - self.before.num_preemptions
        ending = f"{self.mismatches} greedy mismatches, {preemptions} preemptions; at the end: {pool}"
        lines = [f"soak: {self.elapsed:.1f} s, {self.requests} requests: {counts}",
                 f"soak: {ending}; server alive: {self.alive}"]
        for role, (start, end) in sorted(self.rss_mib.items()):
            drift = f"{start:.1f} -> {end:.1f} MiB ({end - start:+.1f})" if start and end else "(gone)"
            lines.append(f"soak: RSS of {role}: {drift}")
        return lines


async def run_soak(settings: SoakSettings, log_file: Path) -> SoakResult:
    """Start a server of its own (its log to log_file), warm it up, soak it, and wait until it is idle again."""
    config = engine_config(max_model_len=settings.max_model_len, dtype=settings.dtype,
                           kv_cache_memory_bytes=[settings.kv_cache_memory_bytes])
    async with LocalServer(config, str(log_file)) as server, AsyncEngineClient(server.address) as observer:
        run = Soak(settings, server.address)
        warm = [run.spawn(run.one_request(observer, random.Random(i), "finish", [False])) for i in range(4)]
        await asyncio.gather(*warm)
        run.requests.clear()
        before = await observer.get_stats()
        processes = group_processes(server.proc.pid)
        rss_start = {pid: rss_mib(pid) for pid in processes}
        elapsed = await run.run()
        after = await wait_idle(observer, before.num_free_blocks + before.num_blocks_held)
        rss = {f"{role} {pid}": (rss_start[pid], rss_mib(pid)) for pid, role in processes.items()}
        alive = server.proc.poll() is None
    return SoakResult(elapsed, len(run.requests), run.outcomes(), run.mismatches, run.errors, before, after, alive, rss)
