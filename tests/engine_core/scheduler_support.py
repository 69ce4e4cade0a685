"""Helpers shared by the scheduler / engine-core tests (no tests in here).

Everything runs through the real EngineCore and the real ReferenceExecutor (with the block-table
digest check on); RecordingExecutor only keeps a copy of every SchedulerOutput it is handed.
"""

from engine_core.core import EngineCore
from engine_core.executor.reference_executor import ReferenceExecutor, reference_next_token
from protocol import EngineCoreOutput, EngineCoreRequest, FullAttentionSpec, SamplingParams, SchedulerOutput
from protocol.config import engine_config

BLOCK_SIZE = 16
SPEC = FullAttentionSpec(BLOCK_SIZE, 1, 8, 2)
VOCAB = 1024


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class RecordingExecutor(ReferenceExecutor):
    """The real ReferenceExecutor, plus a record of what it was asked to run.

    `on_execute(so)` (if set) is called before the reference executor applies the output, while
    the ledger is exactly in the state the scheduler left it in.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.outputs: list[SchedulerOutput] = []
        self.on_execute = None

    def execute_model(self, so: SchedulerOutput, grammar=None):
        self.outputs.append(so)
        if self.on_execute is not None:
            self.on_execute(so)
        return super().execute_model(so, grammar)


def make_core(
    num_blocks: int = 1000,
    max_model_len: int = 1024,
    budget: int = 2048,
    max_num_seqs: int = 256,
    policy: str = "fcfs",
    prefix_caching: bool = True,
    eos_token_ids: list[int] | None = None,
    check_block_tables: bool = True,
    kv_cache_specs: dict | None = None,
    **config_kwargs,
) -> tuple[EngineCore, RecordingExecutor]:
    executor = RecordingExecutor(
        kv_cache_specs=kv_cache_specs or {"layer.0": SPEC},
        vocab_size=VOCAB,
        eos_token_ids=eos_token_ids,
        max_position_embeddings=max(max_model_len, 4096),
    )
    config = engine_config(
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=prefix_caching,
        scheduling_policy=policy,
        num_gpu_blocks_override=num_blocks,
        check_block_tables=check_block_tables,
        **config_kwargs,
    )
    return RecordingEngineCore(config, executor), executor


class RecordingEngineCore(EngineCore):
    """The real EngineCore; every step's client outputs are also gathered in self.results."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.results = Results()

    def step(self):
        outputs = super().step()
        self.results.add(outputs.outputs)
        return outputs


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int = 16,
    arrival_time: float = 0.0,
    priority: int = 0,
    cache_salt: str | None = None,
    **sampling,
) -> EngineCoreRequest:
    sampling.setdefault("ignore_eos", True)
    return EngineCoreRequest(
        request_id,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, **sampling),
        arrival_time,
        cache_salt,
        priority,
    )


def prompt_of(seed: int, length: int) -> list[int]:
    """A deterministic prompt of token ids in [1, VOCAB)."""
    return [1 + (seed * 7919 + i * 104729) % (VOCAB - 1) for i in range(length)]


def expected_tokens(prompt: list[int], n: int, stop: set[int] = frozenset()) -> list[int]:
    """The tokens the reference executor produces for `prompt`, up to n of them or a stop token."""
    tokens, out = list(prompt), []
    for _ in range(n):
        t = reference_next_token(tokens, VOCAB)
        tokens.append(t)
        out.append(t)
        if t in stop:
            break
    return out


class Results:
    """Per-request tokens, finish reasons and cached-token counts, gathered from EngineCoreOutputs."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.num_cached: dict[str, int] = {}

    def add(self, outputs: list[EngineCoreOutput]) -> None:
        for o in outputs:
            if o.finish_reason == "error":  # a rejection: kept apart (a duplicate id shares its id with a live request)
                assert not o.new_token_ids and o.error, f"rejection of {o.request_id} without a text or with tokens"
                self.errors[o.request_id] = o.error
                continue
            assert o.request_id not in self.finish, f"output for {o.request_id} after it finished"
            self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            self.num_cached[o.request_id] = o.num_cached_tokens
            if o.finish_reason is not None:
                self.finish[o.request_id] = o.finish_reason


def check_step_limits(core: EngineCore, so: SchedulerOutput) -> None:
    """Token budget, max_num_seqs and the output's own bookkeeping, for one SchedulerOutput."""
    config = core.config.scheduler
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= config.max_num_seqs
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    new_ids = [r.req_id for r in so.scheduled_new_reqs]
    cached_ids = so.scheduled_cached_reqs.req_ids
    assert not set(new_ids) & set(cached_ids), "a request is both new and cached in one step"
    assert sorted(new_ids + cached_ids) == sorted(so.num_scheduled_tokens)
    gone = set(so.finished_req_ids) | set(so.preempted_req_ids)
    assert not gone & set(so.num_scheduled_tokens), "a finished or preempted request is scheduled"


def run(core: "RecordingEngineCore", executor: RecordingExecutor, max_steps: int = 100_000) -> Results:
    """Step until the engine has no work; check limits after every step. Returns all results so far."""
    seen = len(executor.outputs)
    for _ in range(max_steps):
        if not core.has_work():
            break
        core.step()
        assert len(core.scheduler.running) <= core.config.scheduler.max_num_seqs
        for so in executor.outputs[seen:]:
            check_step_limits(core, so)
        seen = len(executor.outputs)
    else:
        raise AssertionError(f"engine still has work after {max_steps} steps")
    return core.results


def assert_pool_empty(core: EngineCore) -> None:
    manager = core.scheduler.kv_cache_manager
    assert manager.get_num_free_blocks() == core.kv_cache_config.num_blocks - 1
    assert manager.get_usage() == 0.0
    assert not core.scheduler.running and not len(core.scheduler.waiting) and not core.scheduler.requests
