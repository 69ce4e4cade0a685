"""The benchmarks' one way to time: a stopwatch, per-call times, repeats, interleaved rounds and their medians, and
whether a round ran on a quiet machine. Figures are printed, never asserted.

Standard library only: a runner that another venv's python executes (peer_bench's vLLM runner) imports it too.
"""

import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Lap:
    wall: float = 0.0  # seconds
    cpu: float = 0.0  # seconds of this thread's CPU time


@contextmanager
def stopwatch(sync: Callable[[], object] | None = None) -> Iterator[Lap]:
    """`with stopwatch() as lap:` times the block into lap.wall and lap.cpu. sync (e.g. torch.cuda.synchronize)
    runs at both ends, so that work queued on a device is inside the lap."""
    lap = Lap()
    if sync:
        sync()
    wall, cpu = time.perf_counter(), time.thread_time()
    try:
        yield lap
    finally:
        if sync:
            sync()
        lap.wall, lap.cpu = time.perf_counter() - wall, time.thread_time() - cpu


class CallTimes:
    """fn, keeping the wall seconds of every call (and this thread's CPU seconds, with cpu=True); a stand-in for a
    method, e.g. `sched.schedule = CallTimes(sched.schedule)`."""

    def __init__(self, fn: Callable[..., Any], cpu: bool = False, sync: Callable[[], object] | None = None) -> None:
        self.fn, self.sync, self.with_cpu = fn, sync, cpu
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.sync:
            self.sync()
        cpu = time.thread_time() if self.with_cpu else 0.0
        wall = time.perf_counter()
        out = self.fn(*args, **kwargs)
        if self.sync:
            self.sync()
        self.wall.append(time.perf_counter() - wall)
        if self.with_cpu:
            self.cpu.append(time.thread_time() - cpu)
        return out

    def clear(self) -> None:
        self.wall.clear()
        self.cpu.clear()


def repeat(fn: Callable[[], object], repeats: int, warmup: int = 3,
           sync: Callable[[], object] | None = None) -> list[float]:
    """Wall seconds of each of `repeats` calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    timed = CallTimes(fn, sync=sync)
    for _ in range(repeats):
        timed()
    return timed.wall


def interleaved(variants: dict[str, Callable[[int], T]], rounds: int, rotate: bool = True,
                on_result: Callable[[int, str, T], None] | None = None) -> dict[str, list[T]]:
    """Every variant once a round, called with the round's number; with rotate the order turns by one each round,
    so that no variant always runs first (drift of the machine, a cold cache, a neighbour's load spread over all).
    A variant that returns None (a run it discarded) adds nothing that round. on_result sees each other result."""
    names = list(variants)
    results: dict[str, list[T]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names) if rotate else 0
        for name in names[shift:] + names[:shift]:
            result = variants[name](r)
            if result is None:
                continue
            results[name].append(result)
            if on_result:
                on_result(r, name, result)
    return results


def medians(results: dict[str, list[float]]) -> dict[str, float]:
    """The median of each variant's results, for the variants that have any."""
    return {name: statistics.median(values) for name, values in results.items() if values}


# ---- clean rounds: what the rest of the machine did meanwhile ---------------------------------------------------


def cpu_busy_seconds() -> float:
    """Core-seconds all processes of the machine have spent busy since boot (from /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class ForeignLoad:
    cores: float = 0.0  # mean cores that other processes (not this one, not its waited-for children) kept busy


@contextmanager
def foreign_load() -> Iterator[ForeignLoad]:
    """`with foreign_load() as load:` runs a round; load.cores then tells how busy the rest of the machine was, to
    keep only rounds that ran on a quiet machine. Children count as ours once waited for (subprocess.run)."""
    load = ForeignLoad()
    busy, ours = cpu_busy_seconds(), children_cpu_seconds() + time.process_time()
    start = time.monotonic()
    try:
        yield load
    finally:
        wall = max(time.monotonic() - start, 1e-9)
        mine = children_cpu_seconds() + time.process_time() - ours
        load.cores = ((cpu_busy_seconds() - busy) - mine) / wall


def wait_quiet(max_load: float, seconds: float = 60.0) -> bool:
    """Wait until the machine spends less than max_load cores for one second; False if it never does."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = cpu_busy_seconds()
        time.sleep(1.0)
        if cpu_busy_seconds() - before < max_load:
            return True
    return False


def clean_round(name: str, r: int, max_load: float, run: Callable[[], tuple[T | None, float]],
                allowed: float | None = None) -> T | None:
    """Round r of one variant: run() gives (its result or None, the cores other processes used meanwhile). Skipped
    when the machine never got quiet before it; kept when a result came and the others used at most `allowed` cores
    (max_load unless given); a log line either way."""
    if not wait_quiet(max_load):
        print(f"round {r + 1} {name}: the machine never got quiet; skipped", file=sys.stderr)
        return None
    result, foreign = run()
    kept = result is not None and foreign <= (max_load if allowed is None else allowed)
    print(f"round {r + 1} {name}: {result} (other processes: {foreign:.2f} cores) {'kept' if kept else 'discarded'}",
          file=sys.stderr)
    return result if kept else None
