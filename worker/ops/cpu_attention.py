"""kvengine's CPU kernels (in-place paged attention, and a decoder layer's fused elementwise ops): one C++
extension compiled on first use and cached (worker/ops/cpu_build.py says where and when it is rebuilt).

Any reason the extension cannot be had (no compiler, no ninja, a failed build) raises one
CpuAttentionUnavailable naming the cause; the caller falls back to the torch path.
"""

import functools
import logging
from dataclasses import dataclass
from types import ModuleType

import torch

from worker.kv_quant import KVCache, QuantizedKV
from worker.ops.cpu_build import CpuAttentionUnavailable, build_extension, cpu_flags

log = logging.getLogger(__name__)


@dataclass
class CpuAttentionMetadata:
    """One KV cache group's view of a step, built once and shared by all its layers (tensors on the CPU)."""

    block_table: torch.Tensor  # [num_reqs, max_blocks] int32: each scheduled request's block ids, batch order
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32: first query row of each request, then the token count
    seq_lens: torch.Tensor  # [num_reqs] int32: num_computed + num_scheduled (keys the last query sees)
    window: int  # sliding window in tokens; -1: full attention


def build_cpu_metadata(
    table: torch.Tensor,
    rows: torch.Tensor,
    num_computed: torch.Tensor,
    num_scheduled: torch.Tensor,
    block_size: int,
    window: int | None,
) -> CpuAttentionMetadata:
    """From a group's block table [max_num_reqs, max_blocks] and the scheduled requests' rows and counts."""
    seq_lens = (num_computed + num_scheduled).to(torch.int32)
    max_blocks = -(-int(seq_lens.max()) // block_size) if seq_lens.numel() else 0
    block_table = table[:, :max_blocks].index_select(0, rows.long())
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    torch.cumsum(num_scheduled, 0, out=query_start_loc[1:])
    return CpuAttentionMetadata(block_table, query_start_loc, seq_lens, -1 if window is None else window)


def paged_attention_cpu(
    q: torch.Tensor,
    cache: KVCache,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q [tokens, heads, head_size] over the cache [2, kv_heads, num_blocks, block_size, head_size] read in place;
    returns [tokens, heads * head_size]. num_computed of a request is seq_len - its query count; softcap > 0 caps
    the scaled scores to softcap * tanh(score / softcap). A quantized cache's codes and scales are read in place."""
    data, scales = _parts(cache)
    return load_extension().paged_attention(q, data, block_table, query_start_loc, seq_lens, window, scale, softcap,
                                            scales)


def reshape_and_cache_cpu(k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: CpuAttentionMetadata) -> None:
    """Write this step's k, v [tokens, kv_heads, head_size] at the slots the block table gives (quantized where the
    cache is, as worker/kv_quant.py does)."""
    data, scales = _parts(cache)
    load_extension().reshape_and_cache(k, v, data, meta.block_table, meta.query_start_loc, meta.seq_lens, scales)


def _parts(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (cache.data, cache.scales) if isinstance(cache, QuantizedKV) else (cache, None)


def cpu_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: CpuAttentionMetadata, scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The layer's attention: write this step's K/V, then attend over cached + new keys; [tokens, heads*head_size]."""
    reshape_and_cache_cpu(k, v, cache, meta)
    return paged_attention_cpu(q, cache, meta.block_table, meta.query_start_loc, meta.seq_lens, meta.window, scale,
                               softcap)


def load_extension() -> ModuleType:
    """The compiled module: built (first use on this machine) or loaded once per process. A failure is
    kept and raised again on every call, so a caller that falls back pays for one attempt only."""
    module = _load_once()
    if isinstance(module, CpuAttentionUnavailable):
        raise module
    return module


@functools.cache
def _load_once() -> ModuleType | CpuAttentionUnavailable:
    try:
        return build_extension()
    except CpuAttentionUnavailable as e:
        log.warning("%s", e)
        return e


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 matmuls and attention run faster than fp32 here."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})
