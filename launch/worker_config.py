"""What the engine core tells a worker process at spawn time (JSON on its command line)."""

import msgspec


class WorkerConfig(msgspec.Struct, kw_only=True):
    rank: int
    tp_size: int
    engine_address: str
    dist_init_method: str
    model: str | None = None  # None: the built-in tiny model
    device: str = "cpu"
    dtype: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.92
    check_block_tables: bool = False
    torch_threads: int = 1
    log_level: str = "INFO"

    def worker_kwargs(self) -> dict:
        """The keyword arguments of worker.worker.Worker."""
        skip = {"engine_address", "torch_threads", "log_level"}
        return {f: getattr(self, f) for f in self.__struct_fields__ if f not in skip}
