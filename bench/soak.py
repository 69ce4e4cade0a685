"""Soak: mixed load with aborts, vanishing clients and preemption for a while, then every request accounted for.

    python bench/soak.py [--duration 60] [--clients 6] [--connect ADDRESS [--server-pid PID]]

Without --connect it starts its own server with a small KV cache, so that requests get preempted.
Each request ends as one of:
  finished  a finish output ("length" or "stop")
  aborted   by its client on purpose: it left the stream early, or called abort() and got the "abort" output
  vanished  its client closed its socket mid-stream (the server must abort it on the disconnect)
  lost      it ended without a finish output, with an "error" output or an exception
  hung      no end within --hang-bound seconds after the duration
Greedy requests of the same prompt must get the same tokens (checked in float32, our own server's default).
Prints the counts, the pool at the end and the RSS drift of the engine core and each worker; exits 1 if
anything was lost or hung, a float32 token mismatch, or the pool is not back to idle.
"""

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Coroutine
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.client import AsyncEngineClient
from launch.config_args import parse_bytes
from launch.local_server import Interrupted, LocalServer, run_until_signal
from protocol import SamplingParams, SchedulerStats
from protocol.config import engine_config

OUTCOMES = ("finished", "aborted", "vanished", "lost", "hung")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--clients", type=int, default=6, help="concurrent client loops")
    p.add_argument("--connect", metavar="ADDRESS", default=None, help="a running `kvengine serve` instead of our own")
    p.add_argument("--server-pid", type=int, default=None, help="with --connect: its pid, for the RSS figures")
    p.add_argument("--kv-cache-memory-bytes", default="2MiB", help="our own server's KV cache (small: preemption)")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dtype", default="float32", help="our own server's dtype; in float32 (the default) greedy tokens "
                   "of a prompt must not depend on batching or preemption, in bfloat16 near ties may flip")
    p.add_argument("--hang-bound", type=float, default=120.0, help="seconds a request may still take after the load")
    p.add_argument("--server-log", default=None, help="our own server's log (default: a temporary file)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


class Soak:
    def __init__(self, args: argparse.Namespace, address: str) -> None:
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


# ---- processes ----------------------------------------------------------------------------------


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


# ---- the run ------------------------------------------------------------------------------------


async def wait_idle(client: AsyncEngineClient, total_free: int, bound: float = 60.0) -> SchedulerStats:
    """The stats once the pool is back to idle, or the last ones after `bound` seconds (aborts take a step)."""
    end = time.monotonic() + bound
    while True:
        stats = await client.get_stats()
        idle = (stats.num_running_reqs, stats.num_waiting_reqs, stats.num_blocks_held) == (0, 0, 0)
        if (idle and stats.num_free_blocks == total_free) or time.monotonic() > end:
            return stats
        await asyncio.sleep(0.2)


async def soak(args: argparse.Namespace) -> int:
    local = None
    if args.connect is None:
        config = engine_config(max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
                               dtype=args.dtype,
                               kv_cache_memory_bytes=[parse_bytes(args.kv_cache_memory_bytes)])
        args.server_log = args.server_log or tempfile.mktemp(prefix="kvengine-soak-", suffix=".log")
        local = LocalServer(config, args.server_log)
    async with local or contextlib.nullcontext() as server:
        address = server.address if server else args.connect
        pid = server.proc.pid if server and server.proc else args.server_pid
        async with AsyncEngineClient(address) as observer:
            await observer.wait_ready(60)
            run = Soak(args, address)
            warm = [run.spawn(run.one_request(observer, random.Random(i), "finish", [False])) for i in range(4)]
            await asyncio.gather(*warm)
            run.requests.clear()
            before = await observer.get_stats()
            total = before.num_free_blocks + before.num_blocks_held
            processes = group_processes(pid) if pid else {}
            rss_start = {p: rss_mib(p) for p in processes}
            elapsed = await run.run()
            after = await wait_idle(observer, total)
            rss_end = {p: rss_mib(p) for p in processes}
            alive = server.proc.poll() is None if server and server.proc else True

    outcomes = run.outcomes()
    idle = (after.num_running_reqs, after.num_waiting_reqs, after.num_blocks_held, after.num_free_blocks) == (
        0, 0, 0, total)
    print(f"soak: {elapsed:.1f} s of which {args.duration:.0f} s load, {args.clients} clients, server at {address}")
    print(f"{'requests sent':24}{len(run.requests):>8}")
    for outcome in OUTCOMES:
        print(f"  {outcome:22}{outcomes[outcome]:>8}")
    strict = args.connect is None and args.dtype == "float32"
    print(f"{'greedy token mismatches':24}{run.mismatches:>8}  (same prompt, other tokens; "
          f"{'a failure in float32' if strict else 'not counted: may be near ties outside float32'})")
    print(f"{'preemptions':24}{after.num_preemptions - before.num_preemptions:>8}")
    print(f"{'pool at the end':24}free {after.num_free_blocks} / {total} blocks, held {after.num_blocks_held}, "
          f"cached-free {after.num_cached_free_blocks}, running {after.num_running_reqs}, "
          f"waiting {after.num_waiting_reqs}, usage {after.kv_cache_usage:.1%}"
          f"{'' if idle else '  NOT IDLE'}")
    print(f"{'server process alive':24}{'yes' if alive else 'NO'}")
    if processes:
        print(f"{'RSS (MiB)':24}{'start':>8}{'end':>8}{'drift':>8}")
        for p, role in sorted(processes.items(), key=lambda item: item[1]):
            start, end = rss_start[p], rss_end[p]
            figures = f"{start:8.1f}{end:8.1f}{end - start:+8.1f}" if start and end else "  (gone)"
            print(f"  {role + ' ' + str(p):22}{figures}")
    for error in run.errors[:10]:
        print("  lost:", error)
    if args.server_log:
        print(f"server log: {args.server_log}")
    ok = outcomes["lost"] == outcomes["hung"] == 0 and idle and alive and not (strict and run.mismatches)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_until_signal(soak(args))
    except Interrupted as e:
        print(f"soak: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
