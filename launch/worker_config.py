"""What the engine core tells a worker process at spawn time (JSON on its command line)."""

import os

import msgspec

from protocol.config import EngineConfig


class WorkerConfig(msgspec.Struct, kw_only=True):
    rank: int
    engine_address: str
    dist_init_method: str
    torch_threads: int = 1
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)  # the same for every rank


def worker_configs(config: EngineConfig, engine_address: str, dist_init_method: str) -> list[WorkerConfig]:
    tp = config.parallel.tensor_parallel_size
    threads = max(1, (os.cpu_count() or 1) // tp) if config.parallel.device == "cpu" else 1
    return [
        WorkerConfig(rank=rank, engine_address=engine_address, dist_init_method=dist_init_method,
                     torch_threads=threads, engine=config)
        for rank in range(tp)
    ]
