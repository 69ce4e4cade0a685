"""A ModelRunner's KV state, made once the engine core has sized the cache (after the handshake): the KV
tensors, which tensor each layer uses, the block tables, the step's input buffers and the attention backend."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol import KVCacheConfig, KVCacheGroupSpec
from protocol.sizes import cdiv
from worker.attention_backends import Attention, BackendName, CpuKernelAttention, TorchAttention, TritonAttention
from worker.block_table import BlockTables
from worker.input_buffers import StepBuffers
from worker.kv_quant import KVCache, allocate
from worker.memory import cpu_zeros_huge_pages
from worker.model.base import CausalLM


@dataclass(slots=True)
class KVState:
    block_size: int
    windows: list[int | None]  # per KV cache group: its sliding window, None for full attention
    kv_tensors: list[KVCache]  # layer j of every group shares tensor j (quantized: codes and scales)
    layer_slots: list[tuple[int, int]]  # per layer: (its group, its tensor)
    pad_block: int  # padded decode batches write their padding requests' K/V here, past the ledger's blocks
    tables: BlockTables
    attention: Attention
    buffers: StepBuffers
    device: torch.device
    # oneDNN JIT-compiles a matmul kernel per shape for bf16/fp16 on CPU, ~5 ms and ~1 MiB each, kept for the
    # life of the process: padding each step's token count to a few sizes bounds both (fp32 runs MKL's sgemm).
    pad_tokens: bool


def make_kv_state(
    cfg: KVCacheConfig,
    model: CausalLM,
    layer_index: dict[str, int],
    dtype: torch.dtype,
    device: torch.device,
    *,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    attention_backend: BackendName,
    cuda_graph_sizes: list[int] | None,
) -> KVState:
    """The KV state for cfg's block count; the checks of cfg against the model come first."""
    groups = cfg.kv_cache_groups
    block_size = groups[0].kv_cache_spec.block_size
    if any(g.kv_cache_spec.block_size != block_size for g in groups):
        raise ValueError("all KV cache groups must share one block size")
    windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in groups]
    layer_slots = _layer_slots(groups, layer_index, model, windows)
    attention = _make_attention(attention_backend, block_size, max_model_len, model, dtype, device)
    if cuda_graph_sizes and not attention.reads_rows:
        raise ValueError("padded decode batches (CUDA graphs) need the triton or cpu attention backend")
    num_blocks = cfg.num_blocks + (1 if cuda_graph_sizes else 0)  # the padding block
    shape = (2, model.kv_heads_per_rank, num_blocks, block_size, model.cfg.head_dim)
    kv_tensors = _allocate_kv(groups, shape, dtype, device)
    max_blocks = cdiv(max_model_len, block_size)
    graph_max = cuda_graph_sizes[-1] if cuda_graph_sizes else 0
    buffers = StepBuffers(max(padded_num_tokens(max_num_batched_tokens), graph_max), max(max_num_seqs, graph_max),
                          max_blocks, len(groups), device)
    return KVState(block_size, windows, kv_tensors, layer_slots, cfg.num_blocks,
                   BlockTables(len(groups), max_num_seqs, max_blocks, device), attention, buffers, device,
                   pad_tokens=device.type == "cpu" and dtype != torch.float32)


def _allocate_kv(groups: Sequence[KVCacheGroupSpec], shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> list[KVCache]:
    """One cache per tensor slot, in the model's dtype or quantized as the groups' spec says."""
    quant = {g.kv_cache_spec.kv_quant for g in groups}
    if len(quant) != 1:
        raise ValueError(f"all KV cache groups must share one KV cache dtype, got {sorted(quant)}")
    (kv_quant,) = quant

    def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if device.type == "cpu":
            return cpu_zeros_huge_pages(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    num_tensors = max(len(g.layer_names) for g in groups)
    if kv_quant:
        return [allocate(shape, kv_quant, zeros) for _ in range(num_tensors)]
    return [zeros(shape, dtype) for _ in range(num_tensors)]


def _layer_slots(groups: Sequence[KVCacheGroupSpec], layer_index: dict[str, int], model: CausalLM,
                 windows: list[int | None]) -> list[tuple[int, int]]:
    """Per layer: (group, tensor), from the layer names the config's groups carry back."""
    slots: dict[int, tuple[int, int]] = {}  # layer index -> (group, tensor)
    for g, group in enumerate(groups):
        for j, name in enumerate(group.layer_names):
            if name not in layer_index:
                raise ValueError(f"the KV cache config names a layer this model does not have: {name!r}")
            slots[layer_index[name]] = (g, j)
    if len(slots) < len(model.layers):
        raise ValueError("the KV cache config leaves some layers without a KV cache group")
    layer_slots = [slots[i] for i in range(len(model.layers))]
    for i, (g, _) in enumerate(layer_slots):
        if model.layers[i].sliding_window != windows[g]:
            raise ValueError(f"layer {i}'s sliding window does not match its KV cache group {g}'s spec")
    return layer_slots


def _make_attention(backend: BackendName, block_size: int, max_model_len: int, model: CausalLM,
                    dtype: torch.dtype, device: torch.device) -> Attention:
    if backend == "cpu":
        return CpuKernelAttention(block_size)
    if backend == "triton":
        return TritonAttention(block_size)
    return TorchAttention(block_size, max_model_len, model.kv_heads_per_rank, model.cfg.head_dim, dtype, device)


def padded_num_tokens(n: int) -> int:
    """n rounded up to one of a few sizes: powers of two to 8, multiples of 16 to 256, then of 128."""
    if n <= 8:
        return 1 << (n - 1).bit_length()
    step = 16 if n <= 256 else 128
    return -(-n // step) * step
