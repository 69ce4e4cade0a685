"""Applies SchedulerOutputs: request state, block tables, one forward, sampling on rank 0."""

import logging
import time
from dataclasses import dataclass

import torch

from protocol import KVCacheConfig, ModelRunnerOutput, SamplingParams, SchedulerOutput, TokenLogprobs
from protocol.kv_cache_spec import num_skipped_blocks
from protocol.sizes import cdiv
from worker.attention_backends import Attention, BackendName, CpuKernelAttention, TorchAttention, TritonAttention
from worker.block_table import BlockTableMismatch, BlockTables
from worker.cuda_graphs import CudaGraphs, decode_bucket
from worker.input_buffers import StepBuffers
from worker.memory import cpu_zeros_huge_pages
from worker.model.llama import LlamaModel
from worker.sampler import sample, token_logprobs

log = logging.getLogger(__name__)


@dataclass
class RequestState:
    token_ids: list[int]  # prompt + outputs so far
    num_prompt: int
    params: SamplingParams


class ModelRunner:
    def __init__(self, model: LlamaModel, max_num_seqs: int, max_model_len: int, check_block_tables: bool,
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

    def init_kv_cache(self, cfg: KVCacheConfig, dtype: torch.dtype, device) -> None:
        """Allocate KV tensors once: layer j of every group shares tensor j."""
        groups = cfg.kv_cache_groups
        self.block_size = groups[0].kv_cache_spec.block_size
        if any(g.kv_cache_spec.block_size != self.block_size for g in groups):
            raise ValueError("all KV cache groups must share one block size")
        self.windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in groups]
        m = self.model
        # Padded decode batches write their padding requests' K/V to one more block, past the ledger's.
        self.pad_block = cfg.num_blocks
        num_blocks = cfg.num_blocks + (1 if self.cuda_graph_sizes else 0)
        shape = (2, m.kv_heads_per_rank, num_blocks, self.block_size, m.cfg.head_dim)
        num_tensors = max(len(g.layer_names) for g in groups)
        if device.type == "cpu":
            self.kv_tensors = [cpu_zeros_huge_pages(shape, dtype) for _ in range(num_tensors)]
        else:
            self.kv_tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_tensors)]
        slots: dict[int, tuple[int, int]] = {}  # layer index -> (group, tensor)
        for g, group in enumerate(groups):
            for j, name in enumerate(group.layer_names):
                if name not in self.layer_index:
                    raise ValueError(f"the KV cache config names a layer this model does not have: {name!r}")
                slots[self.layer_index[name]] = (g, j)
        if len(slots) < len(m.layers):
            raise ValueError("the KV cache config leaves some layers without a KV cache group")
        self.layer_slots = [slots[i] for i in range(len(m.layers))]
        self._check_windows(groups)
        max_blocks = cdiv(self.max_model_len, self.block_size)
        self.tables = BlockTables(len(groups), self.max_num_seqs, max_blocks, device)
        self.attention: Attention
        if self.attention_backend == "cpu":
            self.attention = CpuKernelAttention(self.block_size)
        elif self.attention_backend == "triton":
            self.attention = TritonAttention(self.block_size)
        else:
            self.attention = TorchAttention(self.block_size, self.max_model_len, m.kv_heads_per_rank, m.cfg.head_dim,
                                            dtype, device)
        if self.cuda_graph_sizes and not self.attention.reads_rows:
            raise ValueError("padded decode batches (CUDA graphs) need the triton or cpu attention backend")
        self.device = device
        graph_max = self.cuda_graph_sizes[-1] if self.cuda_graph_sizes else 0
        self.buffers = StepBuffers(max(padded_num_tokens(self.max_num_batched_tokens), graph_max),
                                   max(self.max_num_seqs, graph_max), max_blocks, len(groups), device)
        # oneDNN JIT-compiles a matmul kernel per shape for bf16/fp16 on CPU, ~5 ms and ~1 MiB each, kept for the
        # life of the process: padding each step's token count to a few sizes bounds both (fp32 runs MKL's sgemm).
        self.pad_tokens = device.type == "cpu" and dtype != torch.float32
        if self.cuda_graph_sizes and device.type == "cuda":
            self._capture()

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

    def _check_windows(self, groups) -> None:
        for i, (g, _) in enumerate(self.layer_slots):
            if self.model.layers[i].sliding_window != self.windows[g]:
                raise ValueError(f"layer {i}'s sliding window does not match its KV cache group {g}'s spec")

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.buffers.wait_for_copies()  # the host buffers and tables change from here on
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            self.requests.pop(req_id, None)
            self.tables.free(req_id)
        batch = self._update_state(so)
        if not batch:
            return ModelRunnerOutput(step=so.step, req_ids=[], sampled_token_ids=[])
        self._null_out_of_window(batch)
        if so.block_table_digests is not None or self.check_block_tables:
            self._verify_tables(so, batch)
        sampled, logprobs = self._run(batch, so.num_scheduled_tokens)
        return ModelRunnerOutput(step=so.step, req_ids=[r for r, _ in batch], sampled_token_ids=sampled,
                                 logprobs=logprobs)

    def _verify_tables(self, so: SchedulerOutput, batch) -> None:
        digests = so.block_table_digests or {}
        for req_id, _ in batch:
            if req_id not in digests:
                raise BlockTableMismatch(
                    f"step {so.step}: block table check is on but {req_id!r} came without a digest"
                )
            self.tables.verify(req_id, digests[req_id])

    def _update_state(self, so: SchedulerOutput) -> list[tuple[str, int]]:
        """Register new requests, append new blocks; the batch as (req_id, num_computed_tokens)."""
        batch = []
        for new in so.scheduled_new_reqs:
            tokens = [*new.prompt_token_ids, *new.output_token_ids]
            self.requests[new.req_id] = RequestState(tokens, len(new.prompt_token_ids), new.sampling_params)
            self.tables.add(new.req_id, new.block_ids)
            batch.append((new.req_id, new.num_computed_tokens))
        cached = so.scheduled_cached_reqs
        for req_id, new_ids, nc in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
            if new_ids is not None:
                self.tables.append(req_id, new_ids)
            batch.append((req_id, nc))
        return [(r, nc) for r, nc in batch if so.num_scheduled_tokens.get(r, 0) > 0]

    def _null_out_of_window(self, batch) -> None:
        """Blocks wholly before a sliding window hold the null block, as in the ledger's view."""
        for g, window in enumerate(self.windows):
            if window is not None:
                for req_id, nc in batch:
                    skipped = num_skipped_blocks(nc, window, self.block_size)
                    self.tables.groups[g].null_skipped(self.tables.rows[req_id], skipped)

    def _run(self, batch: list[tuple[str, int]],
             num_scheduled: dict[str, int]) -> tuple[list[list[int]], list[TokenLogprobs | None] | None]:
        ids, counts, computed, samplers = [], [], [], []
        for i, (req_id, nc) in enumerate(batch):
            state, n = self.requests[req_id], num_scheduled[req_id]
            if nc + n > len(state.token_ids):
                raise ValueError(f"{req_id}: {nc}+{n} scheduled tokens but only {len(state.token_ids)} known")
            ids += state.token_ids[nc : nc + n]
            counts.append(n)
            computed.append(nc)
            if nc + n == len(state.token_ids):
                samplers.append(i)
        num_tokens = len(ids)
        rows = [self.tables.rows[r] for r, _ in batch]
        bucket = decode_bucket(self.cuda_graph_sizes, counts)
        if bucket is not None:  # a decode batch padded to a captured size: every token is a request
            num_padded_tokens, num_padded_reqs = bucket, bucket
        else:
            num_padded_tokens = padded_num_tokens(num_tokens) if self.pad_tokens else num_tokens
            num_padded_reqs = 0
        metas = self._prepare(ids, rows, computed, counts, num_padded_tokens, num_padded_reqs)
        hidden = None if bucket is None else self.graphs.replay(bucket)
        if hidden is None:
            hidden = self._forward(num_padded_tokens, metas, num_tokens if bucket is None else bucket)
        result = self._sample(batch, hidden[:num_tokens], samplers)
        self.buffers.record_copies()
        return result

    def _prepare(self, ids: list[int], rows: list[int], computed: list[int], counts: list[int],
                 num_padded_tokens: int, num_padded_reqs: int) -> list:
        """Fill the persistent buffers with the step; the attention metadata of each layer."""
        buf = self.buffers
        reqs = buf.fill(ids, rows, computed, counts, num_padded_tokens, num_padded_reqs)
        self.tables.commit()
        tables = [t.table for t in self.tables.groups]
        if self.attention.reads_rows:  # the kernels read the scheduled requests' rows, gathered in batch order
            # a graph's batch keeps the table's full width, so its buffer's layout never changes
            width = buf.max_num_blocks if num_padded_reqs else cdiv(int(buf.seq_lens.np[: len(rows)].max()),
                                                                    self.block_size)
            tables = buf.gather_block_tables(tables, reqs.rows, width, num_padded_reqs, self.pad_block)
        metas = [self.attention.metadata(t, w, reqs) for t, w in zip(tables, self.windows, strict=True)]
        return [metas[g] for g, _ in self.layer_slots]

    def _forward(self, num_padded_tokens: int, metas: list, num_tokens: int | None = None) -> torch.Tensor:
        """The model over the buffers' first num_padded_tokens tokens, of which attention sees num_tokens (default:
        all); a padded decode batch's attention sees its padding requests too."""
        buf = self.buffers
        return self.model.forward(
            buf.padded_input_ids(num_padded_tokens),
            buf.padded_positions(num_padded_tokens),
            num_padded_tokens if num_tokens is None else num_tokens,
            [self.kv_tensors[j] for _, j in self.layer_slots],
            metas,
            self.attention,
        )

    def _sample(self, batch, hidden,
                samplers: list[int]) -> tuple[list[list[int]], list[TokenLogprobs | None] | None]:
        """Per request of the batch: its sampled token ([] for a prefill chunk that samples nothing), and on
        rank 0 the log-probabilities of those that asked for them (None: no request did)."""
        out: list[list[int]] = [[] for _ in batch]
        logprobs: list[TokenLogprobs | None] | None = None
        if not samplers:
            return out, logprobs
        last = self.buffers.sample_indices(samplers, len(batch))
        rows = hidden[: len(batch)] if last is None else hidden.index_select(0, last)
        if self.pad_tokens:  # the LM head's matmul too
            rows = torch.nn.functional.pad(rows, (0, 0, 0, padded_num_tokens(len(samplers)) - len(samplers)))
        logits = self.model.logits(rows)
        logits = None if logits is None else logits[: len(samplers)]
        token_ids = torch.empty(len(samplers), dtype=torch.long, device=hidden.device)
        if logits is not None:  # rank 0: the other ranks get None
            states = [self.requests[batch[i][0]] for i in samplers]
            positions = [len(s.token_ids) - s.num_prompt for s in states]
            token_ids = sample(logits, [s.params for s in states], positions)
            if any(s.params.logprobs is not None for s in states):
                logprobs = [None] * len(batch)
                for i, lp in zip(samplers, token_logprobs(logits, token_ids, [s.params.logprobs for s in states]),
                                 strict=True):
                    logprobs[i] = lp
        for i, t in zip(samplers, self.tp.broadcast(token_ids).tolist(), strict=True):
            self.requests[batch[i][0]].token_ids.append(t)
            out[i] = [t]
        return out, logprobs


def padded_num_tokens(n: int) -> int:
    """n rounded up to one of a few sizes: powers of two to 8, multiples of 16 to 256, then of 128."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = 16 if n <= 256 else 128
    return -(-n // step) * step
