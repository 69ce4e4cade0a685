"""One worker rank: loads its model shard, sizes the KV cache, executes SchedulerOutputs."""

import logging
import math

import torch

from protocol import (
    CachedRequestData,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    SlidingWindowSpec,
    WorkerKVReport,
    WorkerReady,
)
from worker import memory
from worker.model.llama import LlamaModel
from worker.model.loader import load_model
from worker.model_runner import ModelRunner
from worker.parallel import TPGroup

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto': bfloat16 on CUDA, float32 on CPU (CPU bfloat16 matmuls are slow here and lose parity)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


class Worker:
    def __init__(
        self,
        rank: int = 0,
        tp_size: int = 1,
        model: str | None = None,
        device: str = "cpu",
        dtype: str = "auto",
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.92,
        check_block_tables: bool = False,
        dist_init_method: str | None = None,
    ):
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is outside tensor parallel size {tp_size}")
        self.device = torch.device(f"cuda:{rank}" if device == "cuda" else device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = _resolve_dtype(dtype, self.device)
        self.rank, self.block_size = rank, block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.kv_cache_memory_bytes, self.gpu_memory_utilization = kv_cache_memory_bytes, gpu_memory_utilization
        cfg, weights = load_model(model, tp_size)
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.tp = TPGroup.init(rank, tp_size, self.device, dist_init_method)
        weights_before = self._allocated()
        self.model = LlamaModel(cfg, weights, self.tp, self.max_model_len, self.dtype, self.device)
        self.weights_bytes = self._allocated() - weights_before
        self.runner = ModelRunner(self.model, max_num_seqs, self.max_model_len, check_block_tables)

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def kv_cache_specs(self) -> dict:
        m = self.model
        common = dict(
            block_size=self.block_size,
            num_kv_heads=m.kv_heads_per_rank,
            head_size=m.cfg.head_dim,
            dtype_bytes=torch.finfo(self.dtype).bits // 8,
        )
        return {
            f"model.layers.{i}.self_attn": (
                FullAttentionSpec(**common) if w is None else SlidingWindowSpec(**common, sliding_window=w)
            )
            for i, w in enumerate(m.cfg.layer_sliding_windows)
        }

    def report_kv(self) -> WorkerKVReport:
        specs = self.kv_cache_specs()
        budget = self._budget()
        memory.check_fits_one_block(budget, memory.bytes_per_block(list(specs.values())))
        log.info("rank %d KV cache budget: %s", self.rank, budget.detail)
        return WorkerKVReport(
            rank=self.rank,
            available_kv_bytes=budget.available_bytes,
            kv_cache_specs=specs,
            eos_token_ids=self.model.cfg.eos_token_ids,
            max_position_embeddings=self.model.cfg.max_position_embeddings,
            vocab_size=self.model.cfg.vocab_size,
            memory_detail=budget.detail,
        )

    def _budget(self) -> memory.KVBudget:
        if self.kv_cache_memory_bytes is not None:
            return memory.explicit_budget(self.kv_cache_memory_bytes)
        if self.device.type != "cuda":
            return memory.cpu_budget(memory.mem_available_bytes())
        return memory.profile_cuda(self.device, self.gpu_memory_utilization, self.weights_bytes, self.profile_run)

    @torch.inference_mode()
    def profile_run(self) -> None:
        """A forward of max_num_batched_tokens tokens (requests of at most max_model_len) on a scratch cache."""
        total, per_req = self.max_num_batched_tokens, min(self.max_model_len, self.max_num_batched_tokens)
        lengths = [per_req] * (total // per_req) + ([total % per_req] if total % per_req else [])
        blocks_per_req = [math.ceil(n / self.block_size) for n in lengths]
        groups = [KVCacheGroupSpec([name], spec) for name, spec in self.kv_cache_specs().items()]
        scratch = ModelRunner(self.model, len(lengths), self.max_model_len, False)
        scratch.init_kv_cache(KVCacheConfig(sum(blocks_per_req) + 1, groups), self.dtype, self.device)
        scratch.execute_model(_profile_output(lengths, blocks_per_req, len(groups)))

    def init_kv_cache(self, cfg: KVCacheConfig) -> WorkerReady:
        self.runner.init_kv_cache(cfg, self.dtype, self.device)
        return WorkerReady(rank=self.rank, num_blocks=cfg.num_blocks)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.tp.shutdown()


def _profile_output(lengths: list[int], blocks_per_req: list[int], num_groups: int) -> SchedulerOutput:
    """Every layer in its own group sharing one scratch tensor: the profile needs memory, not values."""
    reqs, next_block = [], 1
    for i, (n, nb) in enumerate(zip(lengths, blocks_per_req)):
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
