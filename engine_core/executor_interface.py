"""The executor interface: how the engine core reaches its workers, in-process or over ZeroMQ."""

from typing import Protocol

from protocol import KVCacheConfig, ModelRunnerOutput, SchedulerOutput, WorkerKVReport


class Executor(Protocol):
    def determine_available_memory(self) -> list[WorkerKVReport]:
        """Start-up: one report per rank (weights loaded, memory profiled)."""
        ...

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Start-up: every rank allocates its KV tensors for the final block count."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...

    def check_health(self) -> None:
        """Raise if a worker is gone; the engine loop calls it whenever it is idle, so it must not block."""
        ...

    def shutdown(self) -> None:
        ...
