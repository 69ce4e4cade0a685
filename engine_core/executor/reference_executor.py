"""A model-free executor: tokens are a deterministic function of each request's token history.

It follows SchedulerOutputs exactly as a worker does (token histories, block tables rebuilt from
full lists and appended ids) and checks them, so tests and simulations exercise the real
protocol without a model. A constrained request's token is the first its bitmask allows at or after
the reference token (cyclically); the bitmask's rows must be the step's constrained sampling requests.
"""

import numpy as np

from engine_core.executor.abstract import InlineExecutor
from protocol import (
    FullAttentionSpec,
    GrammarOutput,
    KVCacheConfig,
    KVCacheSpec,
    ModelRunnerOutput,
    SchedulerOutput,
    SlidingWindowSpec,
    WorkerKVReport,
    block_ids_digest,
)
from protocol.kv_cache_spec import num_skipped_blocks


def reference_next_token(token_ids: list[int], vocab_size: int) -> int:
    """Depends only on the history, so recompute after preemption gives the same token."""
    return (token_ids[-1] * 31 + len(token_ids) * 7 + 3) % vocab_size


def _accept(tokens: list[int], draft: list[int], vocab_size: int) -> list[int]:
    """The leading drafts equal to the reference tokens, appended to tokens (n-gram speculative decoding)."""
    accepted = []
    for t in draft:
        if t != reference_next_token(tokens, vocab_size):
            break
        tokens.append(t)
        accepted.append(t)
    return accepted


class ReferenceExecutor(InlineExecutor):
    def __init__(
        self,
        available_kv_bytes: list[int] | None = None,
        kv_cache_specs: dict[str, KVCacheSpec] | None = None,
        vocab_size: int = 1024,
        eos_token_ids: list[int] | None = None,
        max_position_embeddings: int = 4096,
    ) -> None:
        self.available_kv_bytes = available_kv_bytes or [1 << 30]
        self.kv_cache_specs = kv_cache_specs or {"layer.0": FullAttentionSpec(16, 1, 8, 2)}
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids or []
        self.max_position_embeddings = max_position_embeddings
        self.kv_cache_config: KVCacheConfig | None = None
        self.token_ids: dict[str, list[int]] = {}
        self.num_computed_tokens: dict[str, int] = {}
        self.block_tables: dict[str, list[list[int]]] = {}
        self.constrained: set[str] = set()  # requests with structured outputs

    def determine_available_memory(self) -> list[WorkerKVReport]:
        return [
            WorkerKVReport(
                rank=rank,
                available_kv_bytes=available,
                kv_cache_specs=self.kv_cache_specs,
                eos_token_ids=self.eos_token_ids,
                max_position_embeddings=self.max_position_embeddings,
                vocab_size=self.vocab_size,
                memory_detail="reference executor: fixed budget",
            )
            for rank, available in enumerate(self.available_kv_bytes)
        ]

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config

    def execute_model(self, so: SchedulerOutput, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        self._update_state(so)
        token_ids, num_computed_tokens = self.token_ids, self.num_computed_tokens
        vocab_size = self.vocab_size
        allowed = self._allowed_rows(so, grammar)
        drafts = so.scheduled_spec_decode_tokens or {}
        sampled: list[list[int]] = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            tokens = token_ids[req_id]
            draft = drafts.get(req_id, [])
            computed = num_computed_tokens[req_id] + num_tokens - len(draft)
            if computed == len(tokens):
                accepted = _accept(tokens, draft, vocab_size)  # greedy verification: the drafts it would sample
                computed += len(accepted)
                token = reference_next_token(tokens, vocab_size)
                if req_id in allowed:
                    ids = allowed[req_id]
                    token = int(ids[np.searchsorted(ids, token) % len(ids)])
                tokens.append(token)
                sampled.append([*accepted, token])
            else:
                sampled.append([])
            num_computed_tokens[req_id] = computed
        return ModelRunnerOutput(step=so.step, req_ids=list(so.num_scheduled_tokens), sampled_token_ids=sampled)

    def _update_state(self, so: SchedulerOutput) -> None:
        """Token histories and block tables as the step leaves them, checked against the ledger's digests."""
        token_ids, num_computed_tokens, block_tables = self.token_ids, self.num_computed_tokens, self.block_tables
        for req_id in [*so.finished_req_ids, *so.preempted_req_ids]:
            token_ids.pop(req_id, None)
            num_computed_tokens.pop(req_id, None)
            block_tables.pop(req_id, None)
            self.constrained.discard(req_id)
        for new in so.scheduled_new_reqs:
            token_ids[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            block_tables[new.req_id] = [list(group) for group in new.block_ids]
            num_computed_tokens[new.req_id] = new.num_computed_tokens
            if new.sampling_params.structured_outputs is not None:
                self.constrained.add(new.req_id)
        cached = so.scheduled_cached_reqs
        columns = zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True)
        for req_id, new_ids, computed in columns:
            if computed != num_computed_tokens[req_id]:
                raise RuntimeError(f"{req_id}: engine says {computed} computed tokens, executor has "
                                   f"{num_computed_tokens[req_id]}")
            if new_ids is not None:
                for table, ids in zip(block_tables[req_id], new_ids, strict=True):
                    table.extend(ids)
        self._null_out_of_window(so)
        if so.block_table_digests is not None:
            for req_id, digest in so.block_table_digests.items():
                if block_ids_digest(block_tables[req_id]) != digest:
                    raise RuntimeError(f"block table of {req_id} differs from the ledger at step {so.step}")

    def _allowed_rows(self, so: SchedulerOutput, grammar: GrammarOutput | None) -> dict[str, np.ndarray]:
        """The allowed token ids of each constrained request that samples, after checking that the bitmask's rows
        are exactly those requests in the batch order (new requests, then running ones)."""
        if grammar is None and not self.constrained:
            return {}
        order = [*(new.req_id for new in so.scheduled_new_reqs), *so.scheduled_cached_reqs.req_ids]
        samplers = [r for r in order if r in self.constrained
                    and self.num_computed_tokens[r] + so.num_scheduled_tokens[r] == len(self.token_ids[r])]
        rows = [] if grammar is None else grammar.structured_output_request_ids
        if rows != samplers:
            raise RuntimeError(f"step {so.step}: bitmask rows {rows}, constrained sampling requests {samplers}")
        if grammar is None:
            return {}
        words = np.frombuffer(grammar.grammar_bitmask, "<i4").reshape(len(rows), -1)
        bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        return {r: np.flatnonzero(b) for r, b in zip(rows, bits, strict=True)}

    def _null_out_of_window(self, so: SchedulerOutput) -> None:
        """As a worker does: blocks wholly before a sliding window hold the null block, as in the ledger.

        The ledger drops them (remove_skipped_blocks) but only appended ids travel, so the worker
        derives the same rule from each scheduled request's computed tokens at the start of the step.
        """
        if self.kv_cache_config is None:
            raise RuntimeError("execute_model before initialize_kv_cache")
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if not isinstance(spec, SlidingWindowSpec):
                continue
            for req_id in so.num_scheduled_tokens:
                skipped = num_skipped_blocks(self.num_computed_tokens[req_id], spec.sliding_window, spec.block_size)
                table = self.block_tables[req_id][g]
                table[: min(skipped, len(table))] = [0] * min(skipped, len(table))

    def check_health(self) -> None:
        pass  # no worker to lose

    def shutdown(self) -> None:
        pass
