"""--cpu-threads-bind auto: the worker's thread count from the load other processes put on its cores."""

import os
import subprocess
import sys
import time

import pytest

from worker.cpu_threads import CoreLoad, cores_busy_seconds, process_cpu_seconds, threads_for


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


def test_a_busy_process_on_the_cores_counts_and_our_own_work_does_not():
    core = max(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, [{core}])\nwhile 1: pass"])
    try:
        load = CoreLoad([core], [os.getpid()])
        time.sleep(1.0)
        assert load.read() >= 0.5  # it has the core to itself, whatever else runs on the machine
        mine = CoreLoad([core], [os.getpid(), busy.pid])  # the busy process counted as ours
        time.sleep(1.0)
        assert mine.read() <= load.read()
    finally:
        busy.kill()
        busy.wait()


def test_own_cpu_time_and_core_busy_time_grow_with_work():
    me, cores = os.getpid(), sorted(os.sched_getaffinity(0))
    before, busy_before = process_cpu_seconds(me), cores_busy_seconds(cores)
    spin(0.3)
    assert process_cpu_seconds(me) - before >= 0.2
    assert cores_busy_seconds(cores) - busy_before >= 0.2
    assert process_cpu_seconds(2**22 + 1) == 0.0  # a process that is gone (above the largest pid)


def test_a_niced_busy_process_does_not_count():
    core = max(os.sched_getaffinity(0))
    busy = subprocess.Popen([sys.executable, "-c",
                             f"import os; os.sched_setaffinity(0, [{core}]); os.nice(19)\nwhile 1: pass"])
    try:
        with_nice = cores_busy_seconds([core])
        without = cores_busy_seconds([core], niced=False)
        time.sleep(1.0)
        assert cores_busy_seconds([core]) - with_nice >= 0.5  # it spins on that core...
        assert (cores_busy_seconds([core]) - with_nice) - (cores_busy_seconds([core], niced=False) - without) >= 0.5
    finally:
        busy.kill()
        busy.wait()
