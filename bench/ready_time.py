"""Seconds from starting `kvengine serve` to a server that serves: the `kvengine ready` log line and the first
200 from the HTTP API's /health. Each run starts the server, waits, and stops it with SIGTERM.

The first start of a run gets an empty kernel cache (XDG_CACHE_HOME in a fresh folder), so it includes building
the CPU attention kernel; the later starts share that folder and load the cached build. The server is the
`kvengine` beside this Python; the flags after `--` go to it.

    python -m bench.ready_time [--starts 2] [--keep-cache] -- [serve flags, e.g. --model FILE.gguf]
"""

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


def one_start(flags: list[str], env: dict[str, str], folder: Path) -> tuple[float, float]:
    """(seconds to the `kvengine ready` line, seconds to a 200 from /health) of one start."""
    port = free_port()
    argv = [str(Path(sys.executable).with_name("kvengine")), "serve", "--address", f"ipc://{folder}/ready.sock",
            "--port", str(port), *flags]
    start = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    ready: list[float] = []

    def watch() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "kvengine ready" in line and not ready:
                ready.append(time.perf_counter() - start)
            if os.environ.get("READY_TIME_LOG"):
                sys.stderr.write(line)

    reader = threading.Thread(target=watch, daemon=True)
    reader.start()
    try:
        while not healthy(port):
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with code {proc.returncode} before it served")
            time.sleep(0.05)
        health = time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        reader.join()
    return (ready[0] if ready else float("nan")), health


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", type=int, default=2, help="starts in a row (default: 2)")
    parser.add_argument("--keep-cache", action="store_true", help="use the usual kernel cache (no fresh one)")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then flags for kvengine serve")
    args = parser.parse_args()
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    with tempfile.TemporaryDirectory(prefix="ready-time-") as tmp:
        env = dict(os.environ) if args.keep_cache else {**os.environ, "XDG_CACHE_HOME": f"{tmp}/cache"}
        for i in range(args.starts):
            ready, health = one_start(flags, env, Path(tmp))
            print(f"start {i + 1}: `kvengine ready` after {ready:.1f} s, /health 200 after {health:.1f} s", flush=True)


if __name__ == "__main__":
    main()
