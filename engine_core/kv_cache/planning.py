"""Memory sizing arithmetic: from per-layer specs and each rank's KV bytes to a KVCacheConfig."""

from collections.abc import Sequence

from protocol.kv_cache_spec import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSizingError,
    KVCacheSpec,
    blocks_per_request,
    bytes_per_block,
    check_fits_one_block,
    group_layers,
)
from protocol.sizes import format_bytes


def get_kv_cache_groups(kv_cache_specs: dict[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    try:
        return group_layers(kv_cache_specs)
    except ValueError as e:
        raise KVCacheSizingError(str(e)) from None


def get_num_blocks(available_bytes: int, block_bytes: int) -> int:
    check_fits_one_block(available_bytes, block_bytes)
    return available_bytes // block_bytes


def get_kv_cache_config(
    kv_cache_specs: dict[str, KVCacheSpec],
    available_bytes_per_rank: Sequence[int],
    max_model_len: int,
    max_num_batched_tokens: int,
    num_gpu_blocks_override: int | None = None,
) -> KVCacheConfig:
    """Every rank gets the smallest block count of all ranks, so block ids mean the same everywhere."""
    groups = get_kv_cache_groups(kv_cache_specs)
    block_bytes = bytes_per_block(groups)
    num_blocks = min(get_num_blocks(available, block_bytes) for available in available_bytes_per_rank)
    if num_gpu_blocks_override is not None:
        num_blocks = num_gpu_blocks_override
    check_max_model_len_fits(groups, num_blocks, max_model_len, max_num_batched_tokens, block_bytes)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)


def check_max_model_len_fits(
    groups: list[KVCacheGroupSpec], num_blocks: int, max_model_len: int, max_num_batched_tokens: int,
    block_bytes: int,
) -> None:
    usable = num_blocks - 1  # block 0 is the null block
    if blocks_per_request(groups, max_model_len, max_num_batched_tokens) <= usable:
        return
    lo, hi = 0, max_model_len  # largest length that fits, by bisection
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_per_request(groups, mid, max_num_batched_tokens) <= usable:
            lo = mid
        else:
            hi = mid - 1
    needed = blocks_per_request(groups, max_model_len, max_num_batched_tokens)
    raise KVCacheSizingError(
        f"One request of max_model_len={max_model_len:,} tokens needs {needed:,} blocks "
        f"({format_bytes(needed * block_bytes)}) of KV cache, more than the {usable:,} usable blocks "
        f"({format_bytes(usable * block_bytes)}) available. The estimated maximum model length is {lo}. "
        "Lower --max-model-len or give the KV cache more memory (--kv-cache-memory-bytes, or "
        "--gpu-memory-utilization on CUDA)."
    )


def capacity_line(kv_cache_config: KVCacheConfig, max_model_len: int, max_num_batched_tokens: int) -> str:
    """The start-up capacity log line. Counts all blocks, the null block included."""
    groups = kv_cache_config.kv_cache_groups
    block_size = groups[0].kv_cache_spec.block_size
    num_tokens = kv_cache_config.num_blocks // len(groups) * block_size
    concurrency = kv_cache_config.num_blocks / blocks_per_request(groups, max_model_len, max_num_batched_tokens)
    return (
        f"KV cache size: {num_tokens:,} tokens, "
        f"maximum concurrency for {max_model_len:,} tokens per request: {concurrency:.2f}x"
    )
