"""InProcExecutor: the engine core's Executor over one in-process Worker (tensor parallel size 1)."""

from collections import deque

from protocol import GrammarOutput, KVCacheConfig, ModelRunnerOutput, SchedulerOutput, WorkerKVReport
from protocol.config import EngineConfig
from worker.worker import Worker


class InProcExecutor:
    def __init__(self, config: EngineConfig):
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("InProcExecutor runs one worker; tensor parallel size > 1 needs worker processes")
        self.worker = Worker(config)
        self._done: deque[ModelRunnerOutput] = deque()  # async scheduling: a step runs at submit
        self._held: SchedulerOutput | None = None  # or, if its bitmask follows, once that is there

    def determine_available_memory(self) -> list[WorkerKVReport]:
        return [self.worker.report_kv()]

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.worker.init_kv_cache(kv_cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def submit(self, scheduler_output: SchedulerOutput, grammar_follows: bool = False) -> None:
        if self._held is not None:
            raise RuntimeError(f"step {scheduler_output.step} submitted before step {self._held.step}'s bitmask")
        if grammar_follows:
            self._held = scheduler_output
        else:
            self._done.append(self.worker.execute_model(scheduler_output))

    def submit_grammar(self, grammar: GrammarOutput) -> None:
        held, self._held = self._held, None
        if held is None or held.step != grammar.step:
            raise RuntimeError(f"a bitmask for step {grammar.step}, which waits for none")
        self._done.append(self.worker.execute_model(held, lambda: grammar))

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._done.popleft()

    def check_health(self) -> None:
        pass  # the worker lives in this process

    def shutdown(self) -> None:
        self.worker.shutdown()
