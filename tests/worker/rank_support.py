"""Tensor-parallel tests: the ranks as spawned processes joined over a free local port (gloo), their results
gathered from a queue, and every process stopped whatever happens."""

import contextlib
import multiprocessing as mp
import queue
from collections.abc import Callable

from tests.e2e.serve_support import free_port


def run_ranks(target: Callable, args: tuple, results_wanted: int, size: int = 2) -> list[tuple]:
    """Run target(rank, port, results, *args) in `size` processes until `results_wanted` tuples were put on results;
    a rank that exits with an error fails the call at once."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, results, *args)) for rank in range(size)]
    for p in procs:
        p.start()
    try:
        got: list[tuple] = []
        while len(got) < results_wanted:
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
            with contextlib.suppress(queue.Empty):
                got.append(results.get(timeout=1))
        return got
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
