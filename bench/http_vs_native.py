"""Output tok/s over the HTTP API vs the native ZeroMQ client on one server, and the API process's CPU time.

    python -m bench.http_vs_native --rounds 3 -- --max-model-len 1024 --kv-cache-memory-bytes 512MiB

Starts one `kvengine serve` (engine flags after --), then alternates `kvengine bench --connect` and
`kvengine bench --backend openai` at the same concurrency and workload (which goes first turns every
round); prints the medians, the ratio, and
the CPU seconds the API process(es) spent per 1,000 streamed tokens (from /proc, user + system).
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.timing import interleaved, medians


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pids: list[int]) -> float:
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def api_pids(server_pid: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == server_pid and b"launch.api_server.process" in (stat.parent / "cmdline").read_bytes():
                pids.append(int(stat.parent.name))
        except (OSError, IndexError):
            continue
    return pids


def wait_healthy(url: str, proc: subprocess.Popen) -> None:
    while proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"kvengine serve exited with code {proc.returncode}")


def bench(flags: list[str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "launch.cli", "bench", "--json", *flags],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--api-server-count", type=int, default=1)
    p.add_argument("engine_flags", nargs="*")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="kvengine-httpbench-")
    address, port = f"ipc://{tmp}/engine.sock", free_port()
    server = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", "--address", address, "--port", str(port),
                               "--api-server-count", str(args.api_server_count), *args.engine_flags],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server)
        load = ["--max-concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
        pids = api_pids(server.pid)
        cpu_per_1k = []

        def native(round_: int) -> float:  # fresh prompts each round: no prefix-cache hits across runs
            return bench(["--connect", address, *load, "--seed", str(round_)])["output_tokens_per_s"]

        def http(round_: int) -> float:
            before = cpu_seconds(pids)
            summary = bench(["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", *load,
                             "--seed", str(1000 + round_)])
            cpu_per_1k.append((cpu_seconds(pids) - before) / summary["output_tokens"] * 1000)
            return summary["output_tokens_per_s"]

        def show(round_: int, name: str, tok_s: float) -> None:
            cpu = f", API CPU {cpu_per_1k[-1] * 1000:.0f} ms / 1k tokens" if name == "http" else ""
            print(f"round {round_}: {name} {tok_s:.0f} tok/s{cpu}", file=sys.stderr)

        m = medians(interleaved({"native": native, "http": http}, args.rounds, on_result=show))
        n, h = m["native"], m["http"]
        print(f"concurrency {args.concurrency}, {args.num_prompts} requests of {args.input_len} + {args.output_len} "
              f"tokens, {args.rounds} rounds (medians), {args.api_server_count} API process(es)")
        print(f"native ZeroMQ client  {n:10.0f} output tok/s")
        print(f"HTTP (openai backend) {h:10.0f} output tok/s  ({h / n - 1:+.1%})")
        print(f"API process CPU time  {statistics.median(cpu_per_1k) * 1000:10.0f} ms per 1,000 streamed tokens")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


if __name__ == "__main__":
    main()
