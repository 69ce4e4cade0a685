"""Decode step time of TP 2 across two hosts (network namespaces joined by a veth pair) vs TP 2 on one.

A third layout runs the two-host processes in one namespace over loopback (`--master-addr 127.0.0.1`),
which separates the cost of the tcp links from that of the veth.

    sudo python -m bench.multihost_bench [--rounds 5] [--requests 8] [--max-tokens 64] [--dtype float32]

Both servers run at once, each rank pinned to its own core (core 0 for rank 0, core 1 for rank 1, on
either layout), and are driven in turn (the order turns every round), with the same greedy prompts. A step's time
is the gap between two consecutive outputs of one stream (every running request gets one token per
decode step); each round gives the median gap over all its streams, and the table the median of the
rounds, with every round's figure. Needs root and iproute2 (ip netns).
"""

import argparse
import asyncio
import itertools
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.timing import interleaved, medians
from launch.client import AsyncEngineClient
from launch.commands.local_server import wait_until_serving
from protocol import SamplingParams
from tests.e2e.netns import SUBNET, two_hosts


async def step_gaps(address: str, batch: list[list[int]], params: SamplingParams) -> list[float]:
    """Seconds between consecutive outputs of each stream, after its first (the prefill)."""
    async def one(client: AsyncEngineClient, prompt: list[int]) -> list[float]:
        times = [time.perf_counter() async for _ in client.generate(prompt, params)]
        return [b - a for a, b in itertools.pairwise(times[1:])]

    async with AsyncEngineClient(address) as client:
        per_stream = await asyncio.gather(*(one(client, p) for p in batch))
    return [gap for gaps in per_stream for gap in gaps]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    rng = random.Random(0)
    batch = [[rng.randrange(1024) for _ in range(32)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    common = ["--dtype", args.dtype, "--max-model-len", "512", "--kv-cache-memory-bytes", "64MiB",
              "--api-server-count", "0"]
    nodes = ["-tp", "2", "--nnodes", "2", "--master-addr", f"{SUBNET}.1"]
    with tempfile.TemporaryDirectory() as tmp, two_hosts() as (head, other):
        logs = Path(tmp)
        one_host = f"ipc://{tmp}/one.sock"
        two_host = f"ipc://{tmp}/two.sock"
        loopback = f"ipc://{tmp}/loopback.sock"
        local = ["-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "29601"]
        procs = [
            head.serve(["-tp", "2", "--cpu-threads-bind", "0|1", "--address", one_host, *common], logs / "one.log"),
            head.serve([*nodes, "--node-rank", "0", "--cpu-threads-bind", "0", "--address", two_host, *common],
                       logs / "head.log"),
            other.serve([*nodes, "--node-rank", "1", "--headless", "--cpu-threads-bind", "1", *common],
                        logs / "other.log"),
            head.serve([*local, "--node-rank", "0", "--cpu-threads-bind", "0", "--address", loopback, *common],
                       logs / "loopback-head.log"),
            head.serve([*local, "--node-rank", "1", "--headless", "--cpu-threads-bind", "1", *common],
                       logs / "loopback-other.log"),
        ]
        try:
            for address, proc in ((one_host, procs[0]), (two_host, procs[1]), (loopback, procs[3])):
                asyncio.run(wait_until_serving(address, proc))
            layouts = {"TP 2 on one host": one_host, "TP 2 across two namespaces": two_host,
                       "TP 2, two hosts on loopback": loopback}

            def layout(address: str):
                return lambda _round: statistics.median(asyncio.run(step_gaps(address, batch, params))) * 1000

            def show(r: int, name: str, ms: float) -> None:
                print(f"round {r + 1}/{args.rounds}: {name} {ms:.2f} ms", flush=True)

            rounds = interleaved({name: layout(address) for name, address in layouts.items()}, args.rounds,
                                 on_result=show)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    report(rounds, args)
    return 0


def report(rounds: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(f"\n{args.requests} requests x {args.max_tokens} greedy tokens, {args.dtype}, built-in model; "
          f"median decode step (ms), median of {args.rounds} rounds")
    print(f"{'layout':<30} {'median':>8}  rounds")
    m = medians(rounds)
    for name, values in rounds.items():
        print(f"{name:<30} {m[name]:>8.2f}  {' '.join(f'{v:.2f}' for v in values)}")
    one, two, _ = m.values()
    print(f"across two namespaces / on one host: {two / one:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
