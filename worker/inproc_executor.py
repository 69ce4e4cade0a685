"""InProcExecutor: the engine core's Executor over one in-process Worker (tensor parallel size 1)."""

from collections import deque

from protocol import KVCacheConfig, ModelRunnerOutput, SchedulerOutput, WorkerKVReport
from protocol.config import EngineConfig
from worker.worker import Worker


class InProcExecutor:
    def __init__(self, config: EngineConfig):
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("InProcExecutor runs one worker; tensor parallel size > 1 needs worker processes")
        self.worker = Worker(config)
        self._done: deque[ModelRunnerOutput] = deque()  # async scheduling: a step runs at submit

    def determine_available_memory(self) -> list[WorkerKVReport]:
        return [self.worker.report_kv()]

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.worker.init_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        self._done.append(self.worker.execute_model(scheduler_output))

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._done.popleft()

    def check_health(self) -> None:
        pass  # the worker lives in this process

    def shutdown(self) -> None:
        self.worker.shutdown()
