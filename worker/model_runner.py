"""Applies SchedulerOutputs: request state, block tables, one forward, sampling on rank 0."""

import logging
import time
from dataclasses import dataclass

import torch

from protocol import KVCacheConfig, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from protocol.kv_cache_spec import num_skipped_blocks
from protocol.sizes import cdiv
from worker.attention_backends import BackendName
from worker.block_table import BlockTableMismatch
from worker.cuda_graphs import CudaGraphs, decode_bucket
from worker.grammar_bitmask import GrammarSource, constrain
from worker.kv_state import KVState, make_kv_state, padded_num_tokens
from worker.model.base import CausalLM
from worker.prompt_logprobs import PromptLogprobs
from worker.sampler import sample, token_logprobs
from worker.sampling_state import SamplingState
from worker.spec_decode import verify_drafts

log = logging.getLogger(__name__)


@dataclass
class RequestState:
    token_ids: list[int]  # prompt + outputs so far
    num_prompt: int


class ModelRunner:
    def __init__(self, model: CausalLM, max_num_seqs: int, max_model_len: int, check_block_tables: bool,
                 attention_backend: BackendName = "torch", max_num_batched_tokens: int = 2048,
                 cuda_graph_sizes: list[int] | None = None):
        """cuda_graph_sizes: decode batches are padded to these sizes, whose graphs are captured on CUDA; on the
        CPU the padded batches run eagerly (tests). None: no padding, no graphs."""
        self.model, self.tp = model, model.tp
        self.attention_backend = attention_backend
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cuda_graph_sizes = sorted(cuda_graph_sizes) if cuda_graph_sizes else None
        self.graphs = CudaGraphs()
        self.check_block_tables = check_block_tables
        self.requests: dict[str, RequestState] = {}
        # The names this rank reports in its KV cache specs; the config's groups come back with them.
        self.layer_names = [f"model.layers.{i}.self_attn" for i in range(len(model.layers))]
        self.layer_index = {name: i for i, name in enumerate(self.layer_names)}
        self.kv_state: KVState | None = None  # made by init_kv_cache, once the engine core has sized the cache
        cfg = model.cfg  # only rank 0 samples: the other ranks get no logits
        self.sampling = (SamplingState(max_num_seqs, cfg.vocab_size, cfg.eos_token_ids, model.lm_head.weight.device)
                         if self.tp.rank == 0 else None)
        self.prompt_logprobs = PromptLogprobs()  # every rank: the LM head's gather runs on all of them

    def init_kv_cache(self, cfg: KVCacheConfig, dtype: torch.dtype, device: torch.device) -> None:
        """Make the KV state for the engine core's block count (once, after the handshake)."""
        self.kv_state = make_kv_state(
            cfg, self.model, self.layer_index, dtype, device, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len, max_num_batched_tokens=self.max_num_batched_tokens,
            attention_backend=self.attention_backend, cuda_graph_sizes=self.cuda_graph_sizes,
        )
        if self.cuda_graph_sizes and device.type == "cuda":
            self._capture()

    @property
    def kv(self) -> KVState:
        if self.kv_state is None:
            raise RuntimeError("the model runner has no KV cache yet: init_kv_cache comes first")
        return self.kv_state

    @torch.inference_mode()
    def _capture(self) -> None:
        assert self.cuda_graph_sizes is not None
        metas: list = []

        def prepare(size: int) -> None:
            metas[:] = self._prepare([], [], [], [], size, size)

        start = time.perf_counter()
        self.graphs.capture(self.cuda_graph_sizes, prepare, lambda size: self._forward(size, metas))
        log.info("CUDA graphs: captured %d decode batch sizes (%s) in %.1f s", len(self.cuda_graph_sizes),
                 ", ".join(map(str, self.cuda_graph_sizes)), time.perf_counter() - start)

    def execute_model(self, so: SchedulerOutput, grammar: GrammarSource | None = None) -> ModelRunnerOutput:
        """grammar: the step's bitmask, for its constrained sampling rows (worker/grammar_bitmask.py)."""
        kv = self.kv
        kv.buffers.wait_for_copies()  # the host buffers and tables change from here on
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self.requests.pop(req_id, None)
            self.prompt_logprobs.remove(req_id)
            if self.sampling is not None and req_id in kv.tables.rows:
                self.sampling.remove(kv.tables.rows[req_id])
            kv.tables.free(req_id)
        batch = self._update_state(so)
        if not batch:
            return ModelRunnerOutput(step=so.step, req_ids=[], sampled_token_ids=[])
        self._null_out_of_window(batch)
        if so.block_table_digests is not None or self.check_block_tables:
            self._verify_tables(so, batch)
        sampled, logprobs = self._run(batch, so.num_scheduled_tokens, grammar, so.scheduled_spec_decode_tokens or {})
        return ModelRunnerOutput(step=so.step, req_ids=[r for r, _ in batch], sampled_token_ids=sampled,
                                 logprobs=logprobs, prompt_logprobs=self.prompt_logprobs.take(batch, sampled))

    def _verify_tables(self, so: SchedulerOutput, batch) -> None:
        kv = self.kv
        digests = so.block_table_digests or {}
        for req_id, _ in batch:
            if req_id not in digests:
                raise BlockTableMismatch(
                    f"step {so.step}: block table check is on but {req_id!r} came without a digest"
                )
            kv.tables.verify(req_id, digests[req_id])

    def _update_state(self, so: SchedulerOutput) -> list[tuple[str, int]]:
        """Register new requests, append new blocks; the batch as (req_id, num_computed_tokens)."""
        kv = self.kv
        batch = []
        for new in so.scheduled_new_reqs:
            tokens = [*new.prompt_token_ids, *new.output_token_ids]
            self.requests[new.req_id] = RequestState(tokens, len(new.prompt_token_ids))
            row = kv.tables.add(new.req_id, new.block_ids)
            if self.sampling is not None:
                self.sampling.add(row, new.sampling_params, new.prompt_token_ids, new.output_token_ids)
            self.prompt_logprobs.add(new.req_id, new.sampling_params, new.prompt_token_ids, new.num_computed_tokens,
                                     len(new.output_token_ids))
            batch.append((new.req_id, new.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        for req_id, new_ids, nc in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
            if new_ids is not None:
                kv.tables.append(req_id, new_ids)
            batch.append((req_id, nc))
        return [(r, nc) for r, nc in batch if so.num_scheduled_tokens.get(r, 0) > 0]

    def _null_out_of_window(self, batch) -> None:
        """Blocks wholly before a sliding window hold the null block, as in the ledger's view."""
        kv = self.kv
        for g, window in enumerate(kv.windows):
            if window is not None:
                for req_id, nc in batch:
                    skipped = num_skipped_blocks(nc, window, kv.block_size)
                    kv.tables.groups[g].null_skipped(kv.tables.rows[req_id], skipped)

    def _run(self, batch: list[tuple[str, int]], num_scheduled: dict[str, int], grammar: GrammarSource | None = None,
             drafts: dict[str, list[int]] | None = None) -> tuple[list[list[int]], list[TokenLogprobs | None] | None]:
        """drafts: per request, n-gram draft tokens after its known ones (counted in num_scheduled), to verify."""
        kv = self.kv
        ids, counts, computed, samplers = [], [], [], []
        drafts = drafts or {}
        for i, (req_id, nc) in enumerate(batch):
            state, n = self.requests[req_id], num_scheduled[req_id]
            draft = drafts.get(req_id, [])
            known = n - len(draft)
            if nc + known > len(state.token_ids):
                raise ValueError(f"{req_id}: {nc}+{known} scheduled tokens but only {len(state.token_ids)} known")
            ids += state.token_ids[nc : nc + known]
            ids += draft
            counts.append(n)
            computed.append(nc)
            if nc + known == len(state.token_ids):
                samplers.append(i)
        num_tokens = len(ids)
        rows = [kv.tables.rows[r] for r, _ in batch]
        bucket = decode_bucket(self.cuda_graph_sizes, counts)
        if bucket is not None:  # a decode batch padded to a captured size: every token is a request
            num_padded_tokens, num_padded_reqs = bucket, bucket
        else:
            num_padded_tokens = padded_num_tokens(num_tokens) if kv.pad_tokens else num_tokens
            num_padded_reqs = 0
        metas = self._prepare(ids, rows, computed, counts, num_padded_tokens, num_padded_reqs)
        hidden = None if bucket is None else self.graphs.replay(bucket)
        if hidden is None:
            hidden = self._forward(num_padded_tokens, metas, num_tokens if bucket is None else bucket)
        if self.prompt_logprobs.pending:
            self.prompt_logprobs.collect(self._logits, hidden[:num_tokens], batch, counts)
        if drafts:
            result = self._sample_with_drafts(batch, hidden[:num_tokens], samplers, drafts, grammar)
        else:
            result = self._sample(batch, hidden[:num_tokens], samplers, grammar)
        kv.buffers.record_copies()
        return result

    def _prepare(self, ids: list[int], rows: list[int], computed: list[int], counts: list[int],
                 num_padded_tokens: int, num_padded_reqs: int) -> list:
        """Fill the persistent buffers with the step; the attention metadata of each layer."""
        kv = self.kv
        buf = kv.buffers
        reqs = buf.fill(ids, rows, computed, counts, num_padded_tokens, num_padded_reqs)
        kv.tables.commit()
        tables = [t.table for t in kv.tables.groups]
        if kv.attention.reads_rows:  # the kernels read the scheduled requests' rows, gathered in batch order
            # a graph's batch keeps the table's full width, so its buffer's layout never changes
            width = buf.max_num_blocks if num_padded_reqs else cdiv(int(buf.seq_lens.np[: len(rows)].max()),
                                                                    kv.block_size)
            tables = buf.gather_block_tables(tables, reqs.rows, width, num_padded_reqs, kv.pad_block)
        metas = [kv.attention.metadata(t, w, reqs) for t, w in zip(tables, kv.windows, strict=True)]
        return [metas[g] for g, _ in kv.layer_slots]

    def _forward(self, num_padded_tokens: int, metas: list, num_tokens: int | None = None) -> torch.Tensor:
        """The model over the buffers' first num_padded_tokens tokens, of which attention sees num_tokens (default:
        all); a padded decode batch's attention sees its padding requests too."""
        kv = self.kv
        buf = kv.buffers
        return self.model.forward(
            buf.padded_input_ids(num_padded_tokens),
            buf.padded_positions(num_padded_tokens),
            num_padded_tokens if num_tokens is None else num_tokens,
            [kv.kv_tensors[j] for _, j in kv.layer_slots],
            metas,
            kv.attention,
        )

    def _sample(self, batch, hidden, samplers: list[int],
                grammar: GrammarSource | None = None) -> tuple[list[list[int]], list[TokenLogprobs | None] | None]:
        """Per request of the batch: its sampled token ([] for a prefill chunk that samples nothing), and on
        rank 0 the log-probabilities of those that asked for them (None: no request did)."""
        kv = self.kv
        out: list[list[int]] = [[] for _ in batch]
        logprobs: list[TokenLogprobs | None] | None = None
        if not samplers:
            return out, logprobs
        last = kv.buffers.sample_indices(samplers, len(batch))
        logits = self._logits(hidden[: len(batch)] if last is None else hidden.index_select(0, last))
        token_ids = torch.empty(len(samplers), dtype=torch.long, device=hidden.device)
        if logits is not None:  # rank 0: the other ranks get None
            token_ids, logprobs = self._sample_logits(logits, samplers, batch, grammar)
        for i, t in zip(samplers, self.tp.broadcast(token_ids).tolist(), strict=True):
            self.requests[batch[i][0]].token_ids.append(t)
            out[i] = [t]
        return out, logprobs

    def _sample_with_drafts(self, batch, hidden, samplers: list[int], drafts: dict[str, list[int]],
                            grammar: GrammarSource | None) -> tuple[list[list[int]], list[TokenLogprobs | None] | None]:
        """_sample for a step that verifies drafts: a drafting request's logits at its last 1 + len(drafts) rows go
        through the rejection sampler (worker/rejection_sampler.py), the others sample as usual; rank 0 decides
        and broadcasts each request's tokens (-1 padded to one width) to the other ranks."""
        buf = self.kv.buffers
        ends = (buf.query_start.np[: len(batch)] + buf.num_scheduled.np[: len(batch)]).tolist()
        lists = [drafts.get(batch[i][0], []) for i in samplers]
        rows = [r for i, d in zip(samplers, lists, strict=True) for r in range(ends[i] - 1 - len(d), ends[i])]
        logits = self._logits(hidden.index_select(0, torch.tensor(rows, device=hidden.device)))
        width = 1 + max(map(len, lists))
        tokens = torch.full((len(samplers), width), -1, dtype=torch.long, device=hidden.device)
        logprobs: list[TokenLogprobs | None] | None = None
        if logits is not None:
            logprobs = verify_drafts(self, logits, samplers, lists, batch, grammar, tokens)
        out: list[list[int]] = [[] for _ in batch]
        for i, row in zip(samplers, self.tp.broadcast(tokens).tolist(), strict=True):
            out[i] = [t for t in row if t >= 0]
            self.requests[batch[i][0]].token_ids += out[i]
        return out, logprobs

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits of hidden rows on rank 0 (None on the others)."""
        n = hidden.shape[0]
        if self.kv.pad_tokens:  # the LM head's matmul too
            hidden = torch.nn.functional.pad(hidden, (0, 0, 0, padded_num_tokens(n) - n))
        logits = self.model.logits(hidden)
        return None if logits is None else logits[:n]

    def _sample_logits(self, logits: torch.Tensor, samplers: list[int], batch: list[tuple[str, int]],
                       grammar: GrammarSource | None) -> tuple[torch.Tensor, list[TokenLogprobs | None] | None]:
        """Rank 0: the sampling rows' tokens (constrained rows masked by their grammar first), and per request of
        the batch the log-probabilities of those that asked for them (None: none did)."""
        assert self.sampling is not None
        num_reqs = len(batch)
        rows = self.kv.buffers.rows.np[:num_reqs][samplers]  # their block table rows: the sampling state's rows
        constrain(logits, self.sampling.structured[rows], [batch[i][0] for i in samplers], grammar)
        meta = self.sampling.metadata(rows)
        token_ids = sample(logits, meta)
        self.sampling.record(rows, token_ids)
        if meta.logprobs is None:
            return token_ids, None
        logprobs: list[TokenLogprobs | None] = [None] * num_reqs
        for i, lp in zip(samplers, token_logprobs(logits, token_ids, meta.logprobs), strict=True):
            logprobs[i] = lp
        return token_ids, logprobs

