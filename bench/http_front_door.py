"""The HTTP front door under hostile clients: how fast it refuses an 8 MB and a 100 MB body, the API process's RSS
meanwhile, and a good client's latency on an idle server, while another user runs a 1,024-prompt request, and
while every hostile load runs at once.

    python -m bench.http_front_door --requests 20 -- --max-model-len 256 --kv-cache-memory-bytes 8MiB

Starts one `kvengine serve` (its flags after --) with the HTTP API on a free port. The hostile loads: threads
sending 8 MB text prompts, 100 MB bodies, 10,000-prompt and 1,024-prompt requests and JSON nested 1,000 deep
in a loop, with 1,000 idle and 50 slowloris connections held open. The good client sends one short request at
a time (3 prompt tokens, 16 output tokens) and its latencies are reported as median / 90th percentile / max.
"""

import argparse
import json
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

GOOD = json.dumps({"prompt": [7, 8, 9], "max_tokens": 16, "ignore_eos": True}).encode()
BIG_TEXT = json.dumps({"prompt": "a" * 8_000_000}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: bytes, path: str = "/v1/completions") -> int:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as e:
        return e.code


def timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def refuse_100mb(port: int) -> tuple[float, bytes]:
    """Seconds from the headers of a 100 MB body to the answer (the body is sent while it is accepted)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        start = time.perf_counter()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: b\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100000000\r\n\r\n")
        sock.settimeout(0.001)
        chunk, answer = b"\0" * 65536, b""
        for _ in range(100_000_000 // 65536):
            try:
                answer = sock.recv(4096)
                break
            except TimeoutError:
                pass
            try:
                sock.sendall(chunk)
            except OSError:
                break
        sock.settimeout(600)
        answer = answer or sock.recv(4096)
        return time.perf_counter() - start, answer.split(b"\r\n", 1)[0]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def api_pid(server: subprocess.Popen) -> int:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"launch.api_server.process" in cmdline.read_bytes():
                stat = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()
                if int(stat[1]) == server.pid:
                    return int(cmdline.parent.name)
        except (OSError, IndexError):
            continue
    raise RuntimeError("no API process")


def latencies(port: int, count: int) -> str:
    """The good client's latencies (median / p90 / max) and how many of its requests were not answered 200."""
    statuses: list[int] = []
    times = sorted(timed(lambda: statuses.append(post(port, GOOD))) for _ in range(count))
    p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
    refused = sum(status != 200 for status in statuses)
    return (f"{statistics.median(times) * 1000:7.0f} / {p90 * 1000:7.0f} / {times[-1] * 1000:7.0f} ms, "
            f"{refused} of {count} not 200")


class Hostile:
    """Threads that repeat a hostile request until stopped, and connections held open; the API's peak RSS."""

    def __init__(self, port: int, pid: int) -> None:
        self.port, self.pid, self.stop, self.peak = port, pid, threading.Event(), 0.0
        self.threads: list[threading.Thread] = []
        self.socks: list[socket.socket] = []

    def repeat(self, work: Callable[[], object]) -> None:
        def loop() -> None:
            while not self.stop.is_set():
                try:
                    work()
                except OSError:
                    time.sleep(0.1)

        self.threads.append(threading.Thread(target=loop, daemon=True))
        self.threads[-1].start()

    def hold(self, idle: int, slow: int) -> None:
        for i in range(idle + slow):
            try:
                sock = socket.create_connection(("127.0.0.1", self.port))
            except OSError:
                continue
            if i >= idle:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: s\r\n")
            self.socks.append(sock)

    def sample(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> "Hostile":  # noqa: PYI034 (Python 3.10 has no typing.Self)
        self.threads.append(threading.Thread(target=self.sample, daemon=True))
        self.threads[-1].start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()
        for sock in self.socks:
            sock.close()


def batch(count: int) -> bytes:
    return json.dumps({"prompt": [[9, 10, 11, 3 + i % 200] for i in range(count)], "max_tokens": 16,
                       "ignore_eos": True}).encode()


def measure(port: int, pid: int, requests: int) -> None:
    print(f"good client, idle server:             {latencies(port, requests)}  (median / p90 / max)")
    status = post(port, BIG_TEXT)
    print(f"8 MB text prompt refused:            {timed(lambda: post(port, BIG_TEXT)) * 1000:7.0f} ms  ({status})")
    seconds, line = refuse_100mb(port)
    print(f"100 MB body refused:                 {seconds * 1000:7.0f} ms  ({line.decode()})")
    print(f"a 1,024-prompt request alone:        {timed(lambda: post(port, batch(1024))) * 1000:7.0f} ms")
    with Hostile(port, pid) as load:
        load.repeat(lambda: post(port, batch(1024)))
        print(f"good client, 1,024 prompts of another user: {latencies(port, requests)}")
    print(f"  API RSS peak meanwhile: {load.peak:.0f} MiB")
    deep = ('{"prompt": ' + "[" * 1000 + "]" * 1000 + "}").encode()
    before = rss_mib(pid)
    with Hostile(port, pid) as load:
        for _ in range(2):
            load.repeat(lambda: post(port, BIG_TEXT))
        load.repeat(lambda: refuse_100mb(port))
        load.repeat(lambda: post(port, batch(10_000)))
        load.repeat(lambda: post(port, batch(1024)))
        load.repeat(lambda: post(port, deep))
        load.hold(1000, 50)
        print(f"good client, every hostile load:     {latencies(port, requests)}")
    print(f"  API RSS: {before:.0f} MiB before, peak {load.peak:.0f} MiB meanwhile, {rss_mib(pid):.0f} MiB after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20, help="good requests per measurement")
    parser.add_argument("serve_flags", nargs="*", help="flags for kvengine serve (after --)")
    args = parser.parse_args()
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/server.log", "wb") as log:
            server = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", "--port", str(port), "--address",
                                       f"ipc://{tmp}/engine.sock", *args.serve_flags], stdout=log, stderr=log)
        try:
            wait_healthy(port, server)
            measure(port, api_pid(server), args.requests)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait()


def wait_healthy(port: int, server: subprocess.Popen) -> None:
    while server.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"kvengine serve exited with {server.returncode}")


if __name__ == "__main__":
    main()
