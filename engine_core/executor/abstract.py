"""The executor interface: how the engine core reaches its workers, in-process or over ZeroMQ."""

from collections import deque
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

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Async scheduling: send a step without waiting for its output."""
        ...

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Async scheduling: the output of the oldest submitted step (scheduler_output)."""
        ...

    def check_health(self) -> None:
        """Raise if a worker is gone; the engine loop calls it whenever it is idle, so it must not block."""
        ...

    def shutdown(self) -> None:
        ...


class InlineExecutor:
    """submit/collect for an executor that runs a step in the caller's thread: the step runs at submit."""

    _done: "deque[ModelRunnerOutput] | None" = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        raise NotImplementedError

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        if self._done is None:
            self._done = deque()
        self._done.append(self.execute_model(scheduler_output))

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not self._done:
            raise RuntimeError(f"collect of step {scheduler_output.step} with no step submitted")
        return self._done.popleft()
