"""kvengine's CPU kernels (in-place paged attention, and a decoder layer's fused elementwise ops): one C++
extension compiled on first use, cached per machine.

The build lives under ~/.cache/kvengine/torch_extensions/ (or $XDG_CACHE_HOME), one folder per torch
version, Python version and CPU vector ISA (torch's own capability check: AVX512, AVX2 or none), so a
second process loads it without compiling and a machine with another ISA gets its own build. Any
reason the extension cannot be had (no compiler, no ninja, a failed build) raises one
CpuAttentionUnavailable naming the cause; the caller falls back to the torch path.
"""

import fcntl
import functools
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("paged_attention.cpp", "layer_ops.cpp", "module.cpp")]
EXTENSION_NAME = "kvengine_paged_attention"
ISA_FLAGS = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512dq",
        "-mavx512vl",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mprefer-vector-width=512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


class CpuAttentionUnavailable(RuntimeError):
    """The CPU attention extension cannot be built or loaded here; use the torch path."""


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
    cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int,
    scale: float,
) -> torch.Tensor:
    """q [tokens, heads, head_size] over the cache [2, kv_heads, num_blocks, block_size, head_size] read in place;
    returns [tokens, heads * head_size]. num_computed of a request is seq_len - its query count."""
    return load_extension().paged_attention(q, cache, block_table, query_start_loc, seq_lens, window, scale)


def reshape_and_cache_cpu(k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: CpuAttentionMetadata) -> None:
    """Write this step's k, v [tokens, kv_heads, head_size] at the slots the block table gives."""
    load_extension().reshape_and_cache(k, v, cache, meta.block_table, meta.query_start_loc, meta.seq_lens)


def cpu_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor, meta: CpuAttentionMetadata, scale: float
) -> torch.Tensor:
    """The layer's attention: write this step's K/V, then attend over cached + new keys; [tokens, heads*head_size]."""
    reshape_and_cache_cpu(k, v, cache, meta)
    return paged_attention_cpu(q, cache, meta.block_table, meta.query_start_loc, meta.seq_lens, meta.window, scale)


def build_directory() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvengine" / "torch_extensions"
    isa = torch.backends.cpu.get_cpu_capability() + ("-bf16" if "-mavx512bf16" in isa_flags() else "")
    return base / f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{isa.lower()}"


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
        return _build()
    except CpuAttentionUnavailable as e:
        log.warning("%s", e)
        return e


def _build() -> ModuleType:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise CpuAttentionUnavailable(f"no C++ compiler: {compiler!r} is not on PATH (set CXX or install g++)")
    if not cpp_extension.is_ninja_available():
        raise CpuAttentionUnavailable("the ninja build tool is missing (pip install ninja)")
    folder = build_directory()
    folder.mkdir(parents=True, exist_ok=True)
    library = folder / f"{EXTENSION_NAME}.so"
    start = time.perf_counter()
    try:
        with open(folder / "build.flock", "w") as flock:
            # One process builds or loads at a time. The kernel drops a flock with its holder, so under it a
            # torch build lock ("lock") can only be one a killed build left, on which torch would wait forever.
            fcntl.flock(flock, fcntl.LOCK_EX)
            if (folder / "lock").exists():
                log.warning("removing the build lock a killed build left in %s", folder)
                (folder / "lock").unlink()
            before = library.stat().st_mtime_ns if library.exists() else None
            module = cpp_extension.load(
                name=EXTENSION_NAME,
                sources=[str(source) for source in SOURCES],
                # -fopenmp: at::parallel_for is inline and runs serially in code built without OpenMP
                extra_cflags=["-O3", "-fopenmp", "-ffp-contract=fast", *isa_flags()],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
            )
    except (RuntimeError, OSError, ImportError) as e:
        raise CpuAttentionUnavailable(f"building the CPU paged attention extension in {folder} failed: {e}") from e
    how = "compiled" if library.stat().st_mtime_ns != before else "loaded the cached build"
    log.info("CPU paged attention: %s in %.1f s (%s)", how, time.perf_counter() - start, folder)
    return module


def isa_flags() -> list[str]:
    flags = ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    if "-mavx512f" in flags and "avx512_bf16" in cpu_flags():
        flags = [*flags, "-mavx512bf16"]  # bf16 attention scores by vdpbf16ps
    return flags


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16: bf16 matmuls and attention run faster than fp32 here."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags line of /proc/cpuinfo (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return frozenset(next(line for line in cpuinfo if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return frozenset()
