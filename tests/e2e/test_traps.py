"""Traps a new user hits, through real processes: a stopped or killed command must take its server with it, and
nothing answering at an address must be one clear line, never a silent wait."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.client import AsyncEngineClient, EngineDeadError
from protocol import SamplingParams
from tests.e2e.conftest import cmdline, wait_until
from tests.e2e.serve_support import free_port

# Workloads far longer than any test waits: the command is stopped while its server is busy.
LONG = {
    "generate": ["generate", "--prompt-token-ids", "1,2,3", "--max-tokens", "1990", "--ignore-eos",
                 "--max-model-len", "2000", "--kv-cache-memory-bytes", "8MiB"],
    "bench": ["bench", "--num-prompts", "100000", "--input-len", "8", "--output-len", "64", "--max-concurrency", "4",
              "--max-model-len", "128", "--kv-cache-memory-bytes", "8MiB", "--json"],
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, timeout=300,
                          check=False)


async def wait_busy(address: str) -> None:
    """Return once the server at address runs a request."""
    async with AsyncEngineClient(address, connect_timeout=120) as client:
        while (await client.get_stats()).num_running_reqs == 0:
            await asyncio.sleep(0.05)


@pytest.mark.parametrize("command, signum", [("generate", signal.SIGKILL), ("generate", signal.SIGTERM),
                                             ("generate", signal.SIGINT), ("bench", signal.SIGKILL),
                                             ("bench", signal.SIGTERM)], ids=lambda v: getattr(v, "name", v))
def test_a_stopped_command_takes_its_server_and_workers_with_it(start_command, command, signum):
    cli = start_command(*LONG[command])
    server = cli.wait_server()
    asyncio.run(wait_busy(server.address))
    workers = [pid for pid in server.processes() if "worker.main" in cmdline(pid)]
    assert len(workers) == 1
    worker_dir = Path(re.search(r'"engine_address":"ipc://([^"]+)/workers.sock"', " ".join(cmdline(workers[0])))[1])
    assert worker_dir.exists()

    os.kill(cli.proc.pid, signum)
    code = cli.wait()
    assert wait_until(lambda: not server.processes()), f"left running: {server.processes()}"
    assert not Path(server.address.removeprefix("ipc://")).exists()
    assert not worker_dir.exists()  # the server shut down cleanly, not killed
    if signum == signal.SIGKILL:
        assert code == -signal.SIGKILL
        return
    assert code == 128 + signum
    stderr = cli.stderr()
    assert "Traceback" not in stderr
    assert [line for line in stderr.splitlines() if line.startswith(f"kvengine {command}:")] == [
        f"kvengine {command}: stopped by {signum.name}"
    ]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_generate_and_bench_have_no_address_flag(command):
    """They start their server on an address of their own; --address used to be accepted and then ignored."""
    proc = run_cli(command, "--address", "ipc:///tmp/kv.sock", "--prompt-token-ids", "1,2")
    assert proc.returncode == 2
    assert "unrecognized arguments: --address ipc:///tmp/kv.sock" in proc.stderr


@pytest.mark.parametrize("scheme", ["ipc", "tcp"])
def test_a_client_where_nothing_listens_fails_after_its_connect_timeout(tmp_path, scheme):
    address = f"ipc://{tmp_path}/nobody.sock" if scheme == "ipc" else f"tcp://127.0.0.1:{free_port()}"
    message = re.escape(f"no kvengine server answers at {address}")

    async def scenario():
        async with AsyncEngineClient(address, connect_timeout=0.5) as client:
            with pytest.raises(EngineDeadError, match=message):
                async for _ in client.generate([1, 2, 3]):
                    pass
            with pytest.raises(EngineDeadError, match=message):
                await client.get_stats()

    asyncio.run(scenario())
    assert AsyncEngineClient(address).connect_timeout == 10.0


def test_the_connect_timeout_ends_once_the_server_has_answered(start_server):
    """A request queued behind another client's long one waits as long as it takes: the server was seen."""
    server = start_server("--max-model-len", "1100", "--kv-cache-memory-bytes", "8MiB", "--max-num-seqs", "1")
    asyncio.run(server.wait_ready())
    long = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def finish_reason(client: AsyncEngineClient, params: SamplingParams, request_id: str) -> str | None:
        return [out async for out in client.generate([1, 2, 3, 4], params, request_id=request_id)][-1].finish_reason

    async def scenario():
        async with AsyncEngineClient(server.address) as first, \
                AsyncEngineClient(server.address, connect_timeout=1.0) as queued:
            busy = asyncio.create_task(finish_reason(first, long, "long"))
            while (await first.get_stats()).num_running_reqs == 0:
                await asyncio.sleep(0.05)
            waiting = asyncio.create_task(finish_reason(queued, short, "queued"))  # --max-num-seqs 1: it queues
            await asyncio.sleep(3.0)  # three connect timeouts in the queue (if long ends sooner, the test is weaker)
            await first.abort("long")
            return await busy, await waiting

    assert asyncio.run(scenario()) in (("abort", "length"), ("length", "length"))


def test_events_says_when_the_replay_endpoint_does_not_answer(tmp_path):
    proc = run_cli("events", f"ipc://{tmp_path}/events", "--replay-endpoint", f"ipc://{tmp_path}/replay",
                   "--timeout", "0.5")
    assert proc.returncode == 1
    assert proc.stderr == f"kvengine events: nothing answers at the KV event replay endpoint ipc://{tmp_path}/replay\n"
    assert proc.stdout == ""


def test_events_with_a_count_and_no_batch_within_the_timeout_exits_1(tmp_path):
    proc = run_cli("events", f"ipc://{tmp_path}/events", "--timeout", "0.5", "--count", "1")
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"kvengine events: no events at ipc://{tmp_path}/events within 0.5 s")
    assert len(proc.stderr.splitlines()) == 1


def test_events_without_a_count_says_so_once_and_keeps_waiting(start_command, tmp_path):
    """An idle server publishes nothing, so without --count the note is all it can honestly say."""
    events = start_command("events", f"ipc://{tmp_path}/events", "--timeout", "0.5")
    assert wait_until(lambda: "no events at" in events.stderr())
    assert events.proc.poll() is None
    events.proc.send_signal(signal.SIGINT)
    assert events.wait() == 0
    assert len(events.stderr().splitlines()) == 1 and events.stdout() == ""


def started_with_sigint_ignored(start_command, *args: str, python: str = "-m launch.cli"):
    """The command as a script's `kvengine ... &` starts it: SIGINT ignored from the start (as nohup-style launchers
    leave it). Python then installs no KeyboardInterrupt, so only a handler of the command's own can stop it."""
    return start_command(shell=f"trap '' INT; exec {sys.executable} {python} {' '.join(args)}")


def test_the_launcher_of_these_tests_leaves_sigint_ignored(start_command):
    probe = started_with_sigint_ignored(start_command,
                                        python="-c 'import signal as s; print(s.getsignal(2) is s.SIG_IGN)'")
    assert probe.wait() == 0 and probe.stdout() == "True\n"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_events_started_with_sigint_ignored_stops_on_sigint_and_sigterm(start_command, tmp_path, signum):
    """Before, SIGINT did nothing to it and test_events_without_a_count_says_so_once_and_keeps_waiting hung."""
    events = started_with_sigint_ignored(start_command, "events", f"ipc://{tmp_path}/events", "--timeout", "0.5")
    assert wait_until(lambda: "no events at" in events.stderr())
    assert events.proc.poll() is None
    events.proc.send_signal(signum)
    assert events.wait() == 0
    assert len(events.stderr().splitlines()) == 1 and events.stdout() == ""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_simulate_started_with_sigint_ignored_stops_with_one_line(start_command, tmp_path, signum):
    trace = tmp_path / "long.jsonl"  # far more requests than the test lets it replay
    trace.write_text("".join(f'{{"timestamp": {i}, "input_length": 600, "output_length": 8, "hash_ids": [{i}, {i}]}}\n'
                             for i in range(200_000)))
    simulate = started_with_sigint_ignored(start_command, "simulate", "--trace", str(trace))
    assert wait_until(lambda: "%|" in simulate.stderr(), 300)  # the replay's progress bar: it runs
    simulate.proc.send_signal(signum)
    assert simulate.wait() == 128 + signum
    assert simulate.stderr().splitlines()[-1] == f"kvengine simulate: stopped by {signal.Signals(signum).name}"
    assert "Traceback" not in simulate.stderr() and simulate.stdout() == ""


def test_events_of_an_idle_server_wait_past_the_timeout_for_the_first_batch(start_server, start_command, tmp_path):
    """The replay socket answered: the server is there, so no batch yet is no error."""
    endpoints = [f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"]
    server = start_server("--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB",
                          "--kv-events-endpoint", endpoints[0], "--kv-events-replay-endpoint", endpoints[1])
    asyncio.run(server.wait_ready())
    events = start_command("events", endpoints[0], "--replay-endpoint", endpoints[1], "--timeout", "0.5",
                           "--count", "1", "--json")
    time.sleep(2)  # past the timeout (a shorter wait only makes the test weaker, never wrong)
    assert events.proc.poll() is None, events.stderr()

    async def one_request():
        async with AsyncEngineClient(server.address) as client:
            async for _ in client.generate(list(range(40)), SamplingParams(max_tokens=2, ignore_eos=True)):
                pass

    asyncio.run(one_request())
    assert events.wait() == 0, events.stderr()
    assert '"BlockStored"' in events.stdout() and events.stderr() == ""
