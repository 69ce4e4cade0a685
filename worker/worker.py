"""One worker rank: loads its model shard, sizes the KV cache, executes SchedulerOutputs."""

import functools
import logging

import torch

from protocol import (
    CachedRequestData,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    SlidingWindowSpec,
    WorkerKVReport,
    WorkerReady,
)
from protocol.config import EngineConfig
from protocol.kv_cache_spec import blocks_per_request, bytes_per_block, check_fits_one_block, group_layers
from protocol.sizes import cdiv
from worker import memory
from worker.attention_backends import resolve_backend
from worker.cuda_graphs import cuda_graph_sizes
from worker.grammar_bitmask import GrammarSource
from worker.kv_connector.disk import DiskConnectorWorker
from worker.kv_connector.factory import make_kv_connector_worker
from worker.kv_connector.fingerprint import kv_fingerprint
from worker.kv_quant import resolve_kv_quant
from worker.model.loader import load_model
from worker.model_runner import ModelRunner
from worker.ops.cpu_attention import cpu_has_bf16, load_extension
from worker.parallel import TPGroup

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on CUDA and on CPUs with bf16 instructions (oneDNN runs its matmuls at about twice
    the fp32 rate there), float32 on other CPUs (emulated bf16 is slower than fp32)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    if name == "bfloat16" and device.type == "cpu" and not cpu_has_bf16():
        log.warning("--dtype bfloat16 on a CPU without bf16 instructions: its matmuls are emulated, slower than "
                    "float32 (what --dtype auto picks here)")
    return _DTYPES[name]


def _check_cuda_build() -> None:
    """--device cuda needs a CUDA build of torch; say so before anything touches torch.cuda."""
    if not torch.backends.cuda.is_built():
        raise ValueError(
            f"--device cuda: this torch build has no CUDA (torch {torch.__version__}); "
            "install a CUDA build of torch or use --device cpu"
        )


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, dist_init_method: str | None = None):
        tp_size = config.parallel.tensor_parallel_size
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is outside tensor parallel size {tp_size}")
        self.config, self.rank = config, rank
        if config.parallel.device == "cuda":
            _check_cuda_build()
        local_rank = rank % (tp_size // config.parallel.nnodes)  # the GPU index on this host
        self.device = torch.device(f"cuda:{local_rank}" if config.parallel.device == "cuda" else config.parallel.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = _resolve_dtype(config.model.dtype, self.device)
        self.kv_quant = resolve_kv_quant(config.cache.kv_cache_dtype, self.dtype)
        self.block_size = config.cache.block_size
        self.max_num_batched_tokens = config.scheduler.max_num_batched_tokens
        self.kv_cache_memory_bytes = config.kv_cache_memory_bytes_of(rank)
        loaded = load_model(config.model.model, tp_size, config.model.model_impl, config.model.quantization)
        self.max_model_len = config.model.max_model_len or loaded.cfg.max_position_embeddings
        self.tp = TPGroup.init(rank, tp_size, self.device, dist_init_method)
        weights_before = self._allocated()
        # The backend is chosen first: with the CPU kernels, the model's norms, rotary and silu * up use them too.
        backend = resolve_backend(config.model.attention_backend, self.device)
        ops = load_extension() if backend == "cpu" else None
        self.model = loaded.build(self.tp, self.max_model_len, self.dtype, self.device, ops)
        self.weights_bytes = self._allocated() - weights_before
        max_num_seqs = config.scheduler.max_num_seqs
        eager = config.model.enforce_eager or not self.model.cuda_graphs
        graph_sizes = cuda_graph_sizes(self.device, eager, backend, tp_size, max_num_seqs)
        self.runner = ModelRunner(self.model, max_num_seqs, self.max_model_len, config.scheduler.check_block_tables,
                                  backend, self.max_num_batched_tokens, graph_sizes)
        log.info("rank %d: %s, KV cache %s, attention backend %s", rank, str(self.dtype).removeprefix("torch."),
                 self.kv_quant or "in the model's dtype", backend)
        self.kv_fingerprint = ""  # the disk tier's folder (--kv-disk-path): set by report_kv
        self.kv_connector: DiskConnectorWorker | None = None  # the disk tier's data side: made by init_kv_cache

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Layer name -> spec; the names are the runner's, which maps them back to layers by its own dict."""
        m = self.model
        common = {
            "block_size": self.block_size,
            "num_kv_heads": m.kv_heads_per_rank,
            "head_size": m.cfg.head_dim,
            "dtype_bytes": 1 if self.kv_quant else torch.finfo(self.dtype).bits // 8,
        }
        q = self.kv_quant
        return {
            name: FullAttentionSpec(**common, kv_quant=q) if w is None
            else SlidingWindowSpec(**common, sliding_window=w, kv_quant=q)
            for name, w in zip(self.runner.layer_names, m.cfg.layer_sliding_windows, strict=True)
        }

    def report_kv(self) -> WorkerKVReport:
        specs = self.kv_cache_specs()
        groups = group_layers(specs)  # as the engine core will group them
        block_bytes = bytes_per_block(groups)
        budget = self._budget(groups, block_bytes)
        check_fits_one_block(budget.available_bytes, block_bytes, budget.detail)
        log.info("rank %d KV cache budget: %s", self.rank, budget.detail)
        if self.config.cache.kv_disk_path is not None:
            self.kv_fingerprint = kv_fingerprint(self.config, self.model.cfg, self.dtype, specs)
        return WorkerKVReport(
            rank=self.rank,
            available_kv_bytes=budget.available_bytes,
            kv_cache_specs=specs,
            eos_token_ids=self.model.cfg.eos_token_ids,
            max_position_embeddings=self.model.cfg.max_position_embeddings,
            vocab_size=self.model.cfg.vocab_size,
            memory_detail=budget.detail,
            kv_fingerprint=self.kv_fingerprint,
        )

    def _budget(self, groups: list[KVCacheGroupSpec], block_bytes: int) -> memory.KVBudget:
        if self.kv_cache_memory_bytes is not None:
            return memory.explicit_budget(self.kv_cache_memory_bytes)
        if self.device.type != "cuda":
            max_num_seqs = self.config.scheduler.max_num_seqs
            request_blocks = blocks_per_request(groups, self.max_model_len, self.max_num_batched_tokens)
            return memory.cpu_budget(
                memory.mem_available_bytes(), max_num_seqs, self.max_model_len, request_blocks, block_bytes
            )
        return memory.profile_cuda(self.device, self.config.cache.gpu_memory_utilization, self.weights_bytes, self.profile_run)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward of max_num_batched_tokens tokens (requests of at most max_model_len) on a scratch cache."""
        total, per_req = self.max_num_batched_tokens, min(self.max_model_len, self.max_num_batched_tokens)
        lengths = [per_req] * (total // per_req) + ([total % per_req] if total % per_req else [])
        blocks_per_req = [cdiv(n, self.block_size) for n in lengths]
        groups = [KVCacheGroupSpec([name], spec) for name, spec in self.kv_cache_specs().items()]
        scratch = ModelRunner(self.model, len(lengths), self.max_model_len, False, self.runner.attention_backend,
                              total)
        scratch.init_kv_cache(KVCacheConfig(sum(blocks_per_req) + 1, groups), self.dtype, self.device)
        scratch.execute_model(_profile_output(lengths, blocks_per_req, len(groups)))

    def init_kv_cache(self, cfg: KVCacheConfig) -> WorkerReady:
        self.runner.init_kv_cache(cfg, self.dtype, self.device)
        self.kv_connector = make_kv_connector_worker(self.config, self.kv_fingerprint, self.rank,
                                                     self.runner.kv.kv_tensors)
        return WorkerReady(rank=self.rank, num_blocks=cfg.num_blocks)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput, grammar: GrammarSource | None = None) -> ModelRunnerOutput:
        """grammar: where the step's bitmask comes from, if constrained requests sample in it (rank 0)."""
        run = functools.partial(self.runner.execute_model, grammar=grammar)
        if self.kv_connector is not None:
            return self.kv_connector.execute(scheduler_output, run)
        return run(scheduler_output)

    def shutdown(self) -> None:
        if self.kv_connector is not None:
            self.kv_connector.shutdown()  # every save sent reaches the disk
        self.tp.shutdown()


def _profile_output(lengths: list[int], blocks_per_req: list[int], num_groups: int) -> SchedulerOutput:
    """Every layer in its own group sharing one scratch tensor: the profile needs memory, not values."""
    reqs, next_block = [], 1
    for i, (n, nb) in enumerate(zip(lengths, blocks_per_req, strict=True)):
        ids = list(range(next_block, next_block + nb))
        next_block += nb
        reqs.append(NewRequestData(f"profile-{i}", [0] * n, [], SamplingParams(temperature=0.0), [ids] * num_groups, 0))
    return SchedulerOutput(
        step=0,
        scheduled_new_reqs=reqs,
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={f"profile-{i}": n for i, n in enumerate(lengths)},
        total_num_scheduled_tokens=sum(lengths),
    )
