"""How many bytes this rank can give the KV cache.

CUDA: total * gpu_memory_utilization - weights - peak activation of a profile forward of
max_num_batched_tokens tokens - memory outside torch's allocator. CPU has no device to profile:
the default is room for max_num_seqs requests of max_model_len tokens, at most CPU_DEFAULT_SHARE
of the RAM the OS reports available. An explicit kv_cache_memory_bytes skips both.
"""

import math
import mmap
from dataclasses import dataclass

import torch

from protocol.sizes import format_bytes

CPU_DEFAULT_SHARE = 0.25
LAZY = "RAM taken as blocks are first written, none zeroed at start-up"  # how cpu_zeros_huge_pages allocates
HUGE_PAGE_BYTES = 2 << 20


@dataclass
class KVBudget:
    available_bytes: int
    detail: str  # the terms, for the start-up log and WorkerKVReport.memory_detail


def cuda_budget(total: int, utilization: float, weights: int, peak_activation: int, non_torch: int) -> KVBudget:
    available = int(total * utilization) - weights - peak_activation - non_torch
    detail = (
        f"total {format_bytes(total)} x gpu_memory_utilization {utilization} - weights {format_bytes(weights)}"
        f" - peak activation {format_bytes(peak_activation)} - non-torch {format_bytes(non_torch)}"
        f" = {format_bytes(available)} for the KV cache"
    )
    return KVBudget(available, detail)


def cpu_budget(
    mem_available: int, max_num_seqs: int, max_model_len: int, blocks_per_request: int, block_bytes: int
) -> KVBudget:
    """Room for max_num_seqs requests of max_model_len tokens (and the null block), capped by a RAM share."""
    wanted = (max_num_seqs * blocks_per_request + 1) * block_bytes
    cap = int(mem_available * CPU_DEFAULT_SHARE)
    room = f"CPU default: room for {max_num_seqs:,} requests of {max_model_len:,} tokens"
    share = f"{CPU_DEFAULT_SHARE:.0%} of available RAM"
    if wanted <= cap:
        rule = f"{room} = {format_bytes(wanted)} (under the cap of {share}, {format_bytes(cap)})"
    else:
        rule = f"{room} would need {format_bytes(wanted)}: capped at {share}, {format_bytes(cap)}"
    return KVBudget(min(wanted, cap), f"{rule}; {LAZY}")


def explicit_budget(kv_cache_memory_bytes: int) -> KVBudget:
    detail = f"--kv-cache-memory-bytes {format_bytes(kv_cache_memory_bytes)} (profiling skipped)"
    return KVBudget(kv_cache_memory_bytes, detail)


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


def cpu_zeros_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on transparent huge pages where the kernel allows them (Linux: THP "always" or
    "madvise"). Attention reads scattered blocks: on 4 KiB pages nearly every block costs a TLB miss.

    The memory is an anonymous mapping, asked for huge pages and never written here: the kernel gives each page
    zeroed when it is first written, so start-up costs nothing and RAM is taken as blocks are first used (zeroing
    a default budget of gigabytes took 3-30 s at every start). The budget's RAM cap keeps it within the machine.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES  # huge pages cover only 2 MiB-aligned ranges
    return raw[start : start + nbytes].view(dtype).view(shape)
