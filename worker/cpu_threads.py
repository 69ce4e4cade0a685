"""--cpu-threads-bind auto: a CPU worker's torch threads follow the cores that other processes leave free.

A worker bound to all its cores runs one torch thread per core while they are free. When another process keeps
one of them busy, the thread that shares its core stalls every other thread at each parallel region's barrier
(measured on 2 cores: 0.05x of the quiet speed on the built-in model), so the worker then runs one thread fewer
per core taken, and the threads it keeps get whole cores (they are not pinned one by one: the kernel moves them
to the free cores). The load of the worker's cores is read from /proc/stat every PERIOD seconds between steps;
the worker's own CPU time and its engine core's do not count, nor niced processes (a build at nice 15 takes
only what the worker leaves).
"""

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


def cores_busy_seconds(cores: list[int], niced: bool = True) -> float:
    """Seconds these cores have spent busy (not idle or waiting for I/O) since boot; niced False leaves out the
    time of processes with a positive nice value (they yield the core to a worker that runs at nice 0)."""
    wanted = {f"cpu{c}" for c in cores}
    busy = 0
    for line in Path("/proc/stat").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] in wanted:
            ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
            busy += sum(ticks) - ticks[3] - ticks[4] - (0 if niced else ticks[1])
    return busy / CLOCK_TICK


def process_cpu_seconds(pid: int) -> float:
    """User + system seconds of a process's threads so far (0 once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICK


class CoreLoad:
    """Cores' worth of work that processes other than `own` did on `cores` between two readings, niced processes
    left out unless this one is niced too (then its own time is counted as niced)."""

    def __init__(self, cores: list[int], own: list[int]) -> None:
        self.cores, self.own = cores, own
        self.niced = os.nice(0) > 0
        self.last = self._now()

    def _now(self) -> tuple[float, float, float]:
        return (time.monotonic(), cores_busy_seconds(self.cores, self.niced),
                sum(process_cpu_seconds(p) for p in self.own))

    def read(self) -> float:
        now = self._now()
        (t0, busy0, own0), (t1, busy1, own1) = self.last, now
        self.last = now
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / max(t1 - t0, 1e-9)


class ThreadGovernor:
    """Called between steps: every PERIOD seconds, torch's thread count from the foreign load of the cores."""

    def __init__(self, cores: list[int], engine_pid: int) -> None:
        self.cores = cores
        self.load = CoreLoad(cores, [os.getpid(), engine_pid])
        self.next = time.monotonic() + PERIOD

    def tick(self) -> None:
        if time.monotonic() < self.next:
            return
        self.next = time.monotonic() + PERIOD
        foreign = self.load.read()
        threads = threads_for(len(self.cores), foreign)
        if threads != torch.get_num_threads():
            logger.info("other processes keep %.1f of this worker's %d cores busy: %d torch threads",
                        foreign, len(self.cores), threads)
            torch.set_num_threads(threads)
