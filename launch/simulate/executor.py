"""The simulated executor and clock: a model-free executor that prices every step with a cost model.

`SimExecutor` follows the SchedulerOutput protocol (new, running, preempted and finished requests;
tokens count once scheduled; a token is sampled when a request has computed all its known tokens)
but keeps only three integers per request, no block tables and no token histories. Sampled tokens
depend only on the position (so recompute after preemption regenerates the same tokens) and are
never EOS. With `check=True` every step also runs through ReferenceExecutor, which rebuilds block
tables and token histories and raises on any protocol mismatch (slower; for tests and debugging).

Cost model (seconds, per step that runs): decode_cost_per_step
  + prefill_cost_per_token * (scheduled tokens that are already known: prompt, or output being recomputed)
  + cost_per_decode_token * (scheduled tokens that produce a new token after the prompt).
The defaults (5 ms, 10 us, 100 us) are a rough 8B-class model on a few H100-class GPUs: 100k
prefill tokens/s (the conversation trace asks for about 41k prompt tokens/s before any cache hit,
so a replay at its own rate keeps up), and a 64-request decode step of about 11 ms. They only shape
the simulated clock (TTFT, and through queueing which requests run together, hence how long a
cached prefix survives); tune them with the flags to model your hardware.
"""

from collections.abc import Callable
from dataclasses import dataclass

from engine_core.executor.abstract import InlineExecutor
from engine_core.executor.reference_executor import ReferenceExecutor
from launch.simulate.tier import SimDiskTier
from launch.simulate.tokens import VOCAB_SIZE
from protocol import (
    FullAttentionSpec,
    GrammarOutput,
    KVCacheConfig,
    KVModelRunnerOutput,
    KVSchedulerOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    WorkerKVReport,
)

DEFAULT_PREFILL_COST_PER_TOKEN = 10e-6
DEFAULT_DECODE_COST_PER_STEP = 5e-3
DEFAULT_COST_PER_DECODE_TOKEN = 100e-6


@dataclass(frozen=True)
class CostModel:
    prefill_cost_per_token: float = DEFAULT_PREFILL_COST_PER_TOKEN
    decode_cost_per_step: float = DEFAULT_DECODE_COST_PER_STEP
    cost_per_decode_token: float = DEFAULT_COST_PER_DECODE_TOKEN

    def step_cost(self, num_prefill_tokens: int, num_decode_tokens: int) -> float:
        return (
            self.decode_cost_per_step
            + self.prefill_cost_per_token * num_prefill_tokens
            + self.cost_per_decode_token * num_decode_tokens
        )


def sim_next_token(position: int) -> int:
    """The token sampled at this position: depends on nothing else, so recompute regenerates it."""
    return (position * 2654435761 + 12345) % VOCAB_SIZE


class SimExecutor(InlineExecutor):
    """Follows SchedulerOutputs like a worker, minus the work a replay does not need (see module doc)."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        cost_model: CostModel | None = None,
        check: bool = False,
        tier: SimDiskTier | None = None,
    ) -> None:
        """tier: the disk tier's model (launch/simulate/tier.py), or None."""
        self.spec = FullAttentionSpec(block_size, 1, 8, 2)
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.cost_model = cost_model or CostModel()
        # request id -> [tokens known when (re)scheduled as new, tokens known now, tokens computed]
        self.state: dict[str, list[int]] = {}
        self.reference = (
            ReferenceExecutor(
                [num_blocks * self.spec.page_size_bytes], {"layer.0": self.spec}, VOCAB_SIZE, [], max_model_len
            )
            if check
            else None
        )
        self.num_steps = 0  # steps that computed tokens (or, with a tier, loaded them)
        self.last_cost = 0.0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.on_execute: Callable[[], None] | None = None  # called before each step's work (usage sampling)
        self.tier = tier

    def determine_available_memory(self) -> list[WorkerKVReport]:
        return [
            WorkerKVReport(
                rank=0,
                available_kv_bytes=self.num_blocks * self.spec.page_size_bytes,
                kv_cache_specs={"layer.0": self.spec},
                eos_token_ids=[],
                max_position_embeddings=self.max_model_len,
                vocab_size=VOCAB_SIZE,
                memory_detail="simulated: fixed block count",
            )
        ]

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        if self.reference is not None:
            self.reference.initialize_kv_cache(kv_cache_config)

    def execute_model(self, so: SchedulerOutput, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        if grammar is not None:
            raise ValueError("the simulator runs no structured outputs (a trace has no grammars)")
        if self.on_execute is not None:
            self.on_execute()
        self._update_states(so)
        if not so.total_num_scheduled_tokens:  # a step that only tells workers of finished/preempted ids
            self.last_cost = 0.0
            req_ids: list[str] = []
            sampled: list[list[int]] = []
        else:
            req_ids, sampled = self._compute(so)
        if self.reference is not None:
            self._check_against_reference(so, req_ids, sampled)
        if self.tier is not None and isinstance(so, KVSchedulerOutput):
            done, load_cost = self.tier.run(so.kv_connector_metadata)
            if not so.total_num_scheduled_tokens:  # a step that only moved blocks: it ran, its loads took time
                self.num_steps += 1
            self.last_cost += load_cost
            return KVModelRunnerOutput(step=so.step, req_ids=req_ids, sampled_token_ids=sampled,
                                       kv_connector_output=done)
        return ModelRunnerOutput(step=so.step, req_ids=req_ids, sampled_token_ids=sampled)

    def _update_states(self, so: SchedulerOutput) -> None:
        state = self.state
        for req_id in so.finished_req_ids:
            state.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            state.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            known = len(new.prompt_token_ids) + len(new.output_token_ids)
            state[new.req_id] = [known, known, new.num_computed_tokens]

    def _compute(self, so: SchedulerOutput) -> tuple[list[str], list[list[int]]]:
        """Advance every scheduled request, sample where a request caught up, and price the step."""
        state = self.state
        req_ids, sampled = [], []
        prefill = decode = 0
        for req_id, n in so.num_scheduled_tokens.items():
            st = state[req_id]
            prefill_end, known, computed = st
            end = computed + n
            p = min(end, prefill_end) - computed if computed < prefill_end else 0
            prefill += p
            decode += n - p
            st[2] = end
            req_ids.append(req_id)
            if end == known:
                sampled.append([sim_next_token(known)])
                st[1] = known + 1
            else:
                sampled.append([])
        self.num_steps += 1
        self.num_prefill_tokens += prefill
        self.num_decode_tokens += decode
        self.last_cost = self.cost_model.step_cost(prefill, decode)
        return req_ids, sampled

    def _check_against_reference(self, so: SchedulerOutput, req_ids: list[str], sampled: list[list[int]]) -> None:
        assert self.reference is not None
        ref = self.reference.execute_model(so)
        if ref.req_ids != req_ids or [len(t) for t in ref.sampled_token_ids] != [len(t) for t in sampled]:
            raise RuntimeError(f"step {so.step}: SimExecutor and ReferenceExecutor sample different requests")

    def check_health(self) -> None:
        pass  # no worker to lose

    def shutdown(self) -> None:
        pass
