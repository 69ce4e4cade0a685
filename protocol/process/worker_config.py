"""What the engine core tells a worker process at spawn time (JSON on its command line)."""

import logging
import os
import re

import msgspec

from protocol.config import EngineConfig, ParallelConfig

logger = logging.getLogger(__name__)


class WorkerConfig(msgspec.Struct, kw_only=True):
    rank: int
    engine_address: str
    dist_init_method: str
    torch_threads: int = 1
    cpu_cores: list[int] | None = None  # the worker pins itself to these cores; None: not pinned
    adapt_threads: bool = False  # fewer torch threads while other processes hold its cores (worker/cpu_threads.py)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)  # the same for every rank of a host
    host: str = ""  # several hosts: this host's label (protocol/process/hosts.py), reported with the KV budget


def local_ranks(parallel: ParallelConfig) -> range:
    """The ranks this host runs: node k of nnodes runs k*local .. (k+1)*local-1, local = tp / nnodes."""
    local = parallel.tensor_parallel_size // parallel.nnodes
    return range(parallel.node_rank * local, (parallel.node_rank + 1) * local)


def worker_configs(config: EngineConfig, engine_address: str, dist_init_method: str,
                   host: str = "") -> list[WorkerConfig]:
    """One config per rank of this host; CPU workers get their cores from --cpu-threads-bind (ValueError if it
    is invalid), which lists this host's ranks."""
    ranks = local_ranks(config.parallel)
    threads = [1] * len(ranks)
    cores: list[list[int] | None] = [None] * len(ranks)
    if config.parallel.device == "cpu":
        threads, cores = cpu_threads(config.parallel.cpu_threads_bind, len(ranks), sorted(os.sched_getaffinity(0)))
        for rank, n, pinned in zip(ranks, threads, cores, strict=True):
            where = "not pinned" if pinned is None else f"on cores {format_cores(pinned)}"
            logger.info("rank %d: %d threads %s", rank, n, where)
    return [
        WorkerConfig(rank=rank, engine_address=engine_address, dist_init_method=dist_init_method,
                     torch_threads=threads[i], cpu_cores=cores[i], engine=config, host=host,
                     adapt_threads=config.parallel.device == "cpu" and config.parallel.cpu_threads_bind == "auto")
        for i, rank in enumerate(ranks)
    ]


def cpu_threads(bind: str, tp: int, usable: list[int]) -> tuple[list[int], list[list[int] | None]]:
    """(torch threads, cores or None) of each rank, from the cores this process may use."""
    if bind == "nobind":
        return [max(1, len(usable) // tp)] * tp, [None] * tp
    cores = auto_binding(usable, tp) if bind == "auto" else parse_binding(bind, tp, usable)
    return [len(c) for c in cores], [*cores]


def auto_binding(usable: list[int], tp: int) -> list[list[int]]:
    """The cores split evenly among the ranks (equal shares: TP ranks wait for each other); with fewer cores than
    ranks, ranks share cores. No core is left to the engine core: it is idle while the workers compute, and the
    workers run fewer threads while another process holds their cores (worker/cpu_threads.py).

    Measured on 2 cores (docs/benchmarks.md): leaving a core to the engine core gave 0.6-0.7x of both cores on
    a SmolLM2-360M-shaped model; both cores with a fixed thread count fell to 0.05x once another process took
    a core."""
    if len(usable) < tp:
        return [[usable[rank % len(usable)]] for rank in range(tp)]
    share = len(usable) // tp
    return [usable[rank * share:(rank + 1) * share] for rank in range(tp)]


def parse_binding(text: str, tp: int, usable: list[int]) -> list[list[int]]:
    """'0-1|2-3' (one core list per rank, as in VLLM_CPU_OMP_THREADS_BIND) -> [[0, 1], [2, 3]]."""
    ranks = text.split("|")
    if len(ranks) != tp:
        raise ValueError(f"--cpu-threads-bind {text!r} gives {len(ranks)} core lists for tensor parallel size {tp} "
                         "(one per rank, separated by |)")
    out = []
    for part in ranks:
        cores: set[int] = set()
        for item in part.split(","):
            match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", item)
            if match is None or int(match[1]) > int(match[2] or match[1]):
                raise ValueError(f"--cpu-threads-bind {text!r}: {item!r} is not a core or a range like 0-3 "
                                 "(use auto, nobind, or one core list per rank like 0-1|2-3)")
            cores.update(range(int(match[1]), int(match[2] or match[1]) + 1))
        outside = cores.difference(usable)
        if outside:
            raise ValueError(f"--cpu-threads-bind {text!r}: cores {format_cores(sorted(outside))} are outside the "
                             f"CPU affinity mask of this process ({format_cores(usable)})")
        out.append(sorted(cores))
    return out


def format_cores(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
