"""--cpu-threads-bind auto: the worker's thread count from the load other processes put on its cores."""

import os
import subprocess
import sys
import time

import pytest
import torch

from worker.cpu_threads import (
    CoreLoad,
    ThreadGovernor,
    cores_busy_seconds,
    freest_cores,
    pin_threads,
    task_cpu_seconds,
    threads_for,
)


@pytest.mark.parametrize(("cores", "foreign", "threads"), [
    (2, 0.0, 2), (2, 0.4, 2),  # a little load elsewhere: every core
    (2, 0.5, 1), (2, 1.0, 1),  # a core at least half taken (a busy loop sharing it shows as 0.5-1): one fewer
    (2, 2.0, 1), (1, 1.0, 1),  # never fewer than one
    (8, 2.6, 5),
])
def test_one_thread_fewer_per_core_taken(cores, foreign, threads):
    assert threads_for(cores, foreign) == threads


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.parametrize(("foreign", "count", "kept", "chosen"), [
    ({0: 0.0, 1: 1.0}, 1, [0, 1], [0]),  # away from the busy core
    ({0: 1.0, 1: 0.02}, 1, [0], [1]),  # it moved: follow it
    ({0: 0.03, 1: 0.0}, 1, [0], [0]),  # near-equal: stay (no flapping on noise)
    ({0: 0.0, 1: 0.0}, 2, [1], [0, 1]),  # free again: every core
    ({0: 0.9, 1: 0.0, 2: 0.1, 3: 0.6}, 2, [0, 1, 2, 3], [1, 2]),
])
def test_threads_go_to_the_freest_cores(foreign, count, kept, chosen):
    assert freest_cores(foreign, count, kept) == chosen


def spin_on(core: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, [{core}])\nwhile 1: pass"])


def stop(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()


def test_a_busy_process_counts_on_its_core_and_our_own_work_does_not():
    core = max(os.sched_getaffinity(0))
    busy = spin_on(core)
    try:
        load = CoreLoad([core], [os.getpid()])
        time.sleep(1.0)
        total, per_core = load.read()
        assert total >= 0.5 and per_core[core] >= 0.5  # it has the core to itself, whatever else runs on the machine
        mine = CoreLoad([core], [os.getpid(), busy.pid])  # the busy process counted as ours
        time.sleep(1.0)
        total, per_core = mine.read()
        assert total <= 0.3 and per_core[core] <= 0.3
    finally:
        stop(busy)


def test_our_children_that_ended_do_not_count():
    """A kernel build's compilers are the worker's own work: after they end, they do not make the cores look taken."""
    core = max(os.sched_getaffinity(0))
    load = CoreLoad([core], [os.getpid()])
    child = (f"import os, time; os.sched_setaffinity(0, [{core}])\n"
             "end = time.monotonic() + 1.0\nwhile time.monotonic() < end: pass")
    subprocess.run([sys.executable, "-c", child], check=True)
    total, _ = load.read()
    assert total <= 0.3


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_governor_drops_a_thread_and_pins_the_rest_away_from_a_busy_core():
    mask, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cores = sorted(mask)[:2]
    torch.set_num_threads(2)
    try:
        busy = spin_on(cores[1])
        governor = ThreadGovernor(cores, os.getppid())
        try:
            spin(1.2)  # our own work on the cores does not count
            governor.tick()
            assert torch.get_num_threads() == 1
            assert governor.kept == [cores[0]] and os.sched_getaffinity(0) == {cores[0]}
        finally:
            stop(busy)
        time.sleep(1.2)
        governor.tick()  # the core is free again: both threads, on both cores
        assert torch.get_num_threads() == 2 and os.sched_getaffinity(0) == set(cores)
    finally:
        pin_threads(sorted(mask))
        torch.set_num_threads(threads)


def test_own_cpu_time_and_core_busy_time_grow_with_work():
    me, cores = os.getpid(), sorted(os.sched_getaffinity(0))

    def own() -> float:
        return sum(seconds for _, seconds in task_cpu_seconds(me).values())

    before, busy_before = own(), sum(cores_busy_seconds(cores).values())
    spin(0.3)
    assert own() - before >= 0.2
    assert sum(cores_busy_seconds(cores).values()) - busy_before >= 0.2
    assert all(core in cores for core, _ in task_cpu_seconds(me).values())
    assert task_cpu_seconds(2**22 + 1) == {}  # a process that is gone (above the largest pid)


def test_a_niced_busy_process_does_not_count():
    core = max(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c",
                             f"import os; os.sched_setaffinity(0, [{core}]); os.nice(19)\nwhile 1: pass"])
    try:
        with_nice = cores_busy_seconds([core])[core]
        without = cores_busy_seconds([core], niced=False)[core]
        time.sleep(1.0)
        assert cores_busy_seconds([core])[core] - with_nice >= 0.5  # it spins on that core...
        assert (cores_busy_seconds([core])[core] - with_nice) - (cores_busy_seconds([core], niced=False)[core]
                                                                  - without) >= 0.5
    finally:
        stop(busy)
