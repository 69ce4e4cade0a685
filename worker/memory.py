"""How many bytes this rank can give the KV cache.

CUDA: total * gpu_memory_utilization - weights - peak activation of a profile forward of
max_num_batched_tokens tokens - memory outside torch's allocator. CPU has no device to profile:
the budget is kv_cache_memory_bytes, or CPU_DEFAULT_SHARE of the RAM the OS reports available.
An explicit kv_cache_memory_bytes skips profiling on either device.
"""

from dataclasses import dataclass

import torch

from protocol import kv_cache_spec

CPU_DEFAULT_SHARE = 0.25
GIB = 1 << 30


@dataclass
class KVBudget:
    available_bytes: int
    detail: str  # the terms, for the start-up log and WorkerKVReport.memory_detail


def cuda_budget(total: int, utilization: float, weights: int, peak_activation: int, non_torch: int) -> KVBudget:
    available = int(total * utilization) - weights - peak_activation - non_torch
    detail = (
        f"total {total / GIB:.2f} GiB x gpu_memory_utilization {utilization} - weights {weights / GIB:.2f} GiB"
        f" - peak activation {peak_activation / GIB:.2f} GiB - non-torch {non_torch / GIB:.2f} GiB"
        f" = {available / GIB:.2f} GiB for the KV cache"
    )
    return KVBudget(available, detail)


def cpu_budget(mem_available: int, share: float = CPU_DEFAULT_SHARE) -> KVBudget:
    available = int(mem_available * share)
    detail = (
        f"CPU: no --kv-cache-memory-bytes, using {share:.0%} of available RAM "
        f"({mem_available / GIB:.2f} GiB) = {available / GIB:.2f} GiB for the KV cache"
    )
    return KVBudget(available, detail)


def explicit_budget(kv_cache_memory_bytes: int) -> KVBudget:
    return KVBudget(kv_cache_memory_bytes, f"--kv-cache-memory-bytes {kv_cache_memory_bytes} (profiling skipped)")


def bytes_per_block(specs: list) -> int:
    """A block's bytes under the grouping rule the engine core plans with."""
    return kv_cache_spec.bytes_per_block(kv_cache_spec.group_layers({str(i): s for i, s in enumerate(specs)}))


def check_fits_one_block(budget: KVBudget, bytes_per_block: int) -> None:
    if budget.available_bytes < bytes_per_block:
        raise MemoryError(
            f"No available memory for the cache blocks: one block needs {bytes_per_block} bytes but the budget is "
            f"{budget.available_bytes} bytes ({budget.detail}); lower the model size or max_num_batched_tokens, "
            f"or raise gpu_memory_utilization / kv_cache_memory_bytes"
        )


def mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux), else total physical memory via os.sysconf."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def profile_cuda(device: torch.device, utilization: float, weights_bytes: int, run_profile) -> KVBudget:
    """Run `run_profile()` (a forward of max_num_batched_tokens tokens) and apply the CUDA formula."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_profile()
    torch.cuda.synchronize(device)
    peak_activation = torch.cuda.max_memory_allocated(device) - before
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return cuda_budget(total, utilization, weights_bytes, peak_activation, non_torch)
