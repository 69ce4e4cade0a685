"""The executor interface: how the engine core reaches its workers, in-process or over ZeroMQ."""

from collections import deque
from typing import Protocol

from protocol import GrammarOutput, KVCacheConfig, ModelRunnerOutput, SchedulerOutput, WorkerKVReport


class Executor(Protocol):
    def determine_available_memory(self) -> list[WorkerKVReport]:
        """Start-up: one report per rank (weights loaded, memory profiled)."""
        ...

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Start-up: every rank allocates its KV tensors for the final block count."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...

    def submit(self, scheduler_output: SchedulerOutput, grammar_follows: bool = False) -> None:
        """Send a step without waiting for its output (async scheduling, or a step whose bitmask follows).
        grammar_follows: constrained requests sample in it; its GrammarOutput comes through submit_grammar, and
        the step samples once it is there."""
        ...

    def submit_grammar(self, grammar: GrammarOutput) -> None:
        """The bitmask of a step submitted with grammar_follows (engine_core/structured_output/)."""
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
    """submit/collect for an executor that runs a step in the caller's thread: the step runs at submit, or once its
    bitmask is there (grammar_follows)."""

    _done: "deque[ModelRunnerOutput] | None" = None
    _held: SchedulerOutput | None = None  # submitted with grammar_follows, waiting for its bitmask

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        raise NotImplementedError

    def submit(self, scheduler_output: SchedulerOutput, grammar_follows: bool = False) -> None:
        if self._held is not None:
            raise RuntimeError(f"step {scheduler_output.step} submitted before step {self._held.step}'s bitmask")
        if self._done is None:
            self._done = deque()
        if grammar_follows:
            self._held = scheduler_output
        else:
            self._done.append(self.execute_model(scheduler_output))

    def submit_grammar(self, grammar: GrammarOutput) -> None:
        held, self._held = self._held, None
        if held is None or held.step != grammar.step:
            raise RuntimeError(f"a bitmask for step {grammar.step}, which waits for none")
        assert self._done is not None
        self._done.append(self.execute_model(held, grammar))

    def collect(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not self._done:
            raise RuntimeError(f"collect of step {scheduler_output.step} with no step submitted")
        return self._done.popleft()
