"""KV cache specs and the final KV cache config: computed by the ledger, sent to every worker."""

import math

import msgspec


def _check_positive(spec: msgspec.Struct, *names: str) -> None:
    for name in names:
        if getattr(spec, name) < 1:
            raise ValueError(f"{type(spec).__name__}.{name} must be at least 1, got {getattr(spec, name)}")
    if spec.head_size_v < 0:
        raise ValueError(f"{type(spec).__name__}.head_size_v must be >= 0, got {spec.head_size_v}")


class FullAttentionSpec(msgspec.Struct, frozen=True, tag=True, array_like=True):
    block_size: int
    num_kv_heads: int  # per tensor-parallel rank
    head_size: int
    dtype_bytes: int
    head_size_v: int = 0  # 0 means equal to head_size

    def __post_init__(self) -> None:
        _check_positive(self, "block_size", "num_kv_heads", "head_size", "dtype_bytes")

    @property
    def page_size_bytes(self) -> int:
        """Bytes of K and V for one block of one layer."""
        head_size_v = self.head_size_v or self.head_size
        return self.num_kv_heads * self.block_size * (self.head_size + head_size_v) * self.dtype_bytes


class SlidingWindowSpec(msgspec.Struct, frozen=True, tag=True, array_like=True):
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    sliding_window: int  # a token attends to itself and the sliding_window - 1 tokens before it
    head_size_v: int = 0

    page_size_bytes = FullAttentionSpec.page_size_bytes

    def __post_init__(self) -> None:
        _check_positive(self, "block_size", "num_kv_heads", "head_size", "dtype_bytes", "sliding_window")


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec


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
