"""--cpu-threads-bind auto: a CPU worker's torch threads follow the cores that other processes leave free.

A worker bound to all its cores runs one torch thread per core while they are free. When another process keeps
one of them busy, the thread that shares its core stalls every other thread at each parallel region's barrier
(measured on 2 cores: 0.05x of the quiet speed on the built-in model), so the worker then runs one thread fewer
per core taken and pins its threads to the cores the others leave freest (on 2 cores with a busy loop on one,
the 360M shape: 22 output tok/s with the thread left to roam both cores, 30 pinned to the free one). The load of
each core is read from /proc/stat every PERIOD seconds between steps; the worker's own CPU time and its engine
core's do not count (a thread's time goes to the core it last ran on), nor niced processes (a build at nice 15
takes only what the worker leaves)."""

import logging
import os
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
PERIOD = 1.0  # seconds between readings; a step is never interrupted
CLOCK_TICK = os.sysconf("SC_CLK_TCK")


def threads_for(cores: int, foreign: float) -> int:
    """Torch threads on `cores` cores where other processes keep `foreign` cores busy: one fewer per core they hold
    at least half the time, at least one."""
    return max(1, cores - int(foreign + 0.5))


def freest_cores(foreign: dict[int, float], count: int, kept: list[int]) -> list[int]:
    """The `count` cores with the least foreign load, those kept now first among near-equals (no flapping)."""
    return sorted(sorted(foreign, key=lambda c: (round(foreign[c], 1), c not in kept, c))[:count])


def cores_busy_seconds(cores: list[int], niced: bool = True) -> dict[int, float]:
    """Per core, the seconds it has spent busy (not idle or waiting for I/O) since boot; niced False leaves out the
    time of processes with a positive nice value (they yield the core to a worker that runs at nice 0)."""
    wanted = {f"cpu{c}": c for c in cores}
    busy: dict[int, float] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            busy[wanted[fields[0]]] = (sum(ticks) - ticks[3] - ticks[4] - (0 if niced else ticks[1])) / CLOCK_TICK
    return busy


def stat_fields(path: str) -> list[str] | None:
    """The fields of a /proc stat file after the command name (which may hold spaces), or None once it is gone."""
    try:
        stat = Path(path).read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def task_cpu_seconds(pid: int) -> dict[int, tuple[int, float]]:
    """Per thread of a process: the core it last ran on and its user + system seconds so far (empty once gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    out: dict[int, tuple[int, float]] = {}
    for tid in tids:
        fields = stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if fields is not None:  # else the thread ended
            out[int(tid)] = (int(fields[36]), (int(fields[11]) + int(fields[12])) / CLOCK_TICK)
    return out


def children_cpu_seconds(pid: int) -> float:
    """User + system seconds of a process's children that ended and were waited for (a kernel build's compilers)."""
    fields = stat_fields(f"/proc/{pid}/stat")
    return 0.0 if fields is None else (int(fields[13]) + int(fields[14])) / CLOCK_TICK


class CoreLoad:
    """Per core, the cores' worth of work that processes other than `own` and their children did on it between two
    readings, niced processes left out unless this one is niced too (then its own time is counted as niced)."""

    def __init__(self, cores: list[int], own: list[int]) -> None:
        self.cores, self.own = cores, own
        self.niced = os.nice(0) > 0
        self.last = self._now()

    def _now(self) -> tuple[float, dict[int, float], dict[int, tuple[int, float]], float]:
        tasks = {tid: t for pid in self.own for tid, t in task_cpu_seconds(pid).items()}
        children = sum(children_cpu_seconds(pid) for pid in self.own)
        return time.monotonic(), cores_busy_seconds(self.cores, self.niced), tasks, children

    def read(self) -> tuple[float, dict[int, float]]:
        """(foreign cores' worth on all the cores, per core): the total is exact; the split assumes each thread ran
        where it was last seen, exact for pinned threads; children's time is left out of the total only."""
        now = self._now()
        (t0, busy0, tasks0, children0), (t1, busy1, tasks1, children1) = self.last, now
        self.last = now
        own = dict.fromkeys(self.cores, 0.0)
        for tid, (core, seconds) in tasks1.items():
            if core in own:
                own[core] += seconds - tasks0.get(tid, (core, 0.0))[1]
        span = max(t1 - t0, 1e-9)
        own_total = sum(own.values()) + children1 - children0
        total = max(0.0, sum(busy1.values()) - sum(busy0.values()) - own_total) / span
        return total, {c: max(0.0, busy1[c] - busy0[c] - own[c]) / span for c in self.cores}


def pin_threads(cores: list[int]) -> None:
    """Every thread of this process (torch's, the main one, the sockets') onto these cores."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):
            continue  # the thread ended


class ThreadGovernor:
    """Called between steps: every PERIOD seconds, torch's thread count and the cores they run on from the foreign
    load of each core."""

    def __init__(self, cores: list[int], engine_pid: int) -> None:
        self.cores = self.kept = sorted(cores)
        self.load = CoreLoad(cores, [os.getpid(), engine_pid])
        self.next = time.monotonic() + PERIOD

    def tick(self) -> None:
        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + PERIOD
        total, per_core = self.load.read()
        threads = threads_for(len(self.cores), total)
        kept = freest_cores(per_core, threads, self.kept)
        if kept != self.kept:
            logger.info("other processes keep %.1f of this worker's %d cores busy: %d torch threads on cores %s",
                        total, len(self.cores), threads, kept)
            pin_threads(kept)
            torch.set_num_threads(threads)
            self.kept = kept
