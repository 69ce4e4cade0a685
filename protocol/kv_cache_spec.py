"""KV cache specs and the final KV cache config: computed by the ledger, sent to every worker."""

import math
from typing import Literal

import msgspec

from protocol.sizes import cdiv, format_bytes


class KVCacheSizingError(ValueError):
    """Start-up cannot size the KV cache; the message says what to change."""


def _check_positive(spec: "KVCacheSpec", *names: str) -> None:
    for name in names:
        if getattr(spec, name) < 1:
            raise ValueError(f"{type(spec).__name__}.{name} must be at least 1, got {getattr(spec, name)}")
    if spec.head_size_v < 0:
        raise ValueError(f"{type(spec).__name__}.head_size_v must be >= 0, got {spec.head_size_v}")


# A quantized KV cache stores one byte a value and, per block, KV head and K/V, one fp32 scale (worker/kv_quant.py).
KVQuant = Literal["", "int8", "fp8_e4m3", "fp8_e5m2"]  # "": unquantized, dtype_bytes a value
KV_SCALE_BYTES = 4


def _check_quant(spec: "KVCacheSpec") -> None:
    if spec.kv_quant and spec.dtype_bytes != 1:
        raise ValueError(f"{type(spec).__name__}: a {spec.kv_quant} KV cache stores 1 byte a value, not "
                         f"{spec.dtype_bytes}")


class FullAttentionSpec(msgspec.Struct, frozen=True, tag=True, array_like=True):
    block_size: int
    num_kv_heads: int  # per tensor-parallel rank
    head_size: int
    dtype_bytes: int
    head_size_v: int = 0  # 0 means equal to head_size
    kv_quant: KVQuant = ""

    def __post_init__(self) -> None:
        _check_positive(self, "block_size", "num_kv_heads", "head_size", "dtype_bytes")
        _check_quant(self)

    @property
    def page_size_bytes(self: "KVCacheSpec") -> int:
        """Bytes of K and V for one block of one layer, a quantized cache's scales included."""
        head_size_v = self.head_size_v or self.head_size
        values = self.block_size * (self.head_size + head_size_v) * self.dtype_bytes
        return self.num_kv_heads * (values + (2 * KV_SCALE_BYTES if self.kv_quant else 0))


class SlidingWindowSpec(msgspec.Struct, frozen=True, tag=True, array_like=True):
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    sliding_window: int  # a token attends to itself and the sliding_window - 1 tokens before it
    head_size_v: int = 0
    kv_quant: KVQuant = ""

    page_size_bytes = FullAttentionSpec.page_size_bytes

    def __post_init__(self) -> None:
        _check_positive(self, "block_size", "num_kv_heads", "head_size", "dtype_bytes", "sliding_window")
        _check_quant(self)


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


def num_skipped_blocks(num_computed_tokens: int, sliding_window: int, block_size: int) -> int:
    """Leading blocks wholly before the window of token num_computed_tokens: both sides hold the null block there."""
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


def max_sliding_window_blocks(sliding_window: int, block_size: int, max_num_batched_tokens: int) -> int:
    """Most real blocks a sliding-window request holds at once: window - 1 + chunk tokens, +1 for an unaligned start."""
    return cdiv(sliding_window - 1 + max_num_batched_tokens, block_size) + 1


class KVCacheGroupSpec(msgspec.Struct, frozen=True, array_like=True):
    """Layers that share one block table. Layer j of every group uses KV tensor j."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


class KVCacheConfig(msgspec.Struct, frozen=True, array_like=True):
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]


def group_layers(kv_cache_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Group layers by spec into equal-sized groups, so that layer j of every group can share KV
    tensor j (a block id belongs to one group at a time): one group if all specs are equal.
    The rule both sides rely on: the engine core plans with it, a worker sizes its budget with it."""
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in kv_cache_specs.items():
        by_spec.setdefault(spec, []).append(name)
    if len(by_spec) == 1:
        ((spec, names),) = by_spec.items()
        return [KVCacheGroupSpec(names, spec)]
    page_sizes = {spec.page_size_bytes for spec in by_spec}
    if len(page_sizes) != 1:
        raise ValueError(f"layers with different attention types must have equal page sizes, got {page_sizes}")
    group_size = math.gcd(*(len(names) for names in by_spec.values()))
    return [
        KVCacheGroupSpec(names[i : i + group_size], spec)
        for spec, names in by_spec.items()
        for i in range(0, len(names), group_size)
    ]


def bytes_per_block(groups: list[KVCacheGroupSpec]) -> int:
    """Bytes one block id costs on one rank: the page sizes of a group's layers, summed; max over groups."""
    return max(sum(group.kv_cache_spec.page_size_bytes for _ in group.layer_names) for group in groups)


def blocks_per_request(groups: list[KVCacheGroupSpec], num_tokens: int, max_num_batched_tokens: int) -> int:
    """Block ids one request of num_tokens holds at its peak, over all groups."""
    total = 0
    for group in groups:
        spec = group.kv_cache_spec
        needed = cdiv(num_tokens, spec.block_size)
        if isinstance(spec, SlidingWindowSpec):
            cap = max_sliding_window_blocks(spec.sliding_window, spec.block_size, max_num_batched_tokens)
            needed = min(needed, cap)
        total += needed
    return total


def check_fits_one_block(available_bytes: int, block_bytes: int, detail: str = "") -> None:
    """The start-up error of a KV cache budget below one block, on either side (vLLM's wording, our flags)."""
    if available_bytes >= block_bytes:
        return
    need, have = format_bytes(block_bytes), format_bytes(available_bytes)
    if need == have:  # rounded to the same figure: the bytes tell them apart
        need, have = f"{block_bytes:,} bytes", f"{available_bytes:,} bytes"
    terms = f" ({detail})" if detail else ""
    raise KVCacheSizingError(
        f"No available memory for the cache blocks: one block needs {need} but the KV cache "
        f"budget is {have}{terms}. Try increasing --kv-cache-memory-bytes; on CUDA, increase "
        "--gpu-memory-utilization or lower --max-num-batched-tokens (it sets the size of the profile run)."
    )
