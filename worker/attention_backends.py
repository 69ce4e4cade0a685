"""The ways a layer attends over the paged cache; the runner picks one at start-up (--attention-backend).

All take the same step (StepRequests and each group's block table) and the same layer inputs, write
this step's K/V at their slots and return [tokens, heads * head_size]:
- `cpu`: the C++ kernel of worker/ops, which reads K/V in place through the block table for the whole
  mixed batch (no gather, no padding);
- `triton`: the Triton kernel of worker/ops/triton_attention.py, the same in-place reading for CUDA (on
  CPU only under TRITON_INTERPRET=1, for tests); triton is imported lazily, so the worker runs without it;
- `torch`: gathers each request's K/V and calls SDPA; runs on any device and is the reference the
  kernels are tested against.
"""

import logging
import os
from typing import TYPE_CHECKING, Literal

import torch

from protocol.sizes import cdiv
from worker.attention import (
    DECODE_CHUNK_BYTES,
    AttentionMetadata,
    GatherBuffer,
    StepRequests,
    build_metadata,
    paged_attention,
)
from worker.ops.cpu_attention import (
    CpuAttentionMetadata,
    CpuAttentionUnavailable,
    cpu_paged_attention,
    load_extension,
)

if TYPE_CHECKING:
    from worker.ops.triton_attention import TritonAttentionMetadata

log = logging.getLogger(__name__)

BackendName = Literal["torch", "cpu", "triton"]


def triton_missing() -> str | None:
    """Why the Triton kernel cannot be used in this environment, or None."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed (pip install 'kvengine[cuda]'): {e}"
    return None


def resolve_backend(requested: str, device: torch.device) -> BackendName:
    """auto: the C++ kernel on CPU (torch if it cannot be built here, with a warning), the Triton kernel on
    CUDA (torch if triton is missing, with a warning). Loads (first use on this machine: compiles) the C++
    kernel now, so the cost falls in start-up."""
    if requested == "torch":
        return "torch"
    if requested == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--attention-backend triton runs on CUDA; on the CPU only with TRITON_INTERPRET=1 set")
        if (why := triton_missing()) is not None:
            raise ValueError(f"--attention-backend triton: {why}")
        return "triton"
    if device.type != "cpu":
        if requested == "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU only, not on {device.type}")
        if (why := triton_missing()) is not None:
            log.warning("Attention falls back to the torch path: %s", why)
            return "torch"
        return "triton"
    try:
        load_extension()
    except CpuAttentionUnavailable as e:
        if requested == "cpu":
            raise ValueError(f"--attention-backend cpu: {e}") from e
        log.warning("Attention falls back to the torch path: %s", e)
        return "torch"
    return "cpu"


class TorchAttention:
    """Gather + SDPA per span (worker/attention.py), with one scratch buffer shared by every layer."""

    reads_rows = False  # metadata() takes a group's whole block table

    def __init__(self, block_size: int, max_model_len: int, kv_heads: int, head_size: int, dtype, device) -> None:
        self.block_size = block_size
        self.kv_bytes_per_token = 2 * kv_heads * head_size * torch.finfo(dtype).bits // 8
        max_tokens = max(cdiv(max_model_len, block_size) * block_size, DECODE_CHUNK_BYTES // self.kv_bytes_per_token)
        self.buffer = GatherBuffer(max_tokens, kv_heads, head_size, dtype, device)

    def metadata(self, table: torch.Tensor, window: int | None, reqs: StepRequests) -> AttentionMetadata:
        return build_metadata(table, self.block_size, window, reqs, self.kv_bytes_per_token)

    def __call__(self, q, k, v, cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                 softcap: float | None = None) -> torch.Tensor:
        return paged_attention(q, k, v, cache, meta, self.buffer, scale, softcap)


def kernel_metadata(block_table: torch.Tensor, window: int | None, reqs: StepRequests) -> CpuAttentionMetadata:
    assert reqs.query_start_loc is not None and reqs.seq_lens is not None, "the runner's buffers fill these"
    return CpuAttentionMetadata(block_table, reqs.query_start_loc, reqs.seq_lens, -1 if window is None else window)


class CpuKernelAttention:
    """The in-place C++ kernel; its metadata is the block table rows of the step's requests plus their lengths."""

    reads_rows = True  # metadata() takes the scheduled requests' block table rows, not the whole table

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def metadata(self, block_table: torch.Tensor, window: int | None, reqs: StepRequests) -> CpuAttentionMetadata:
        return kernel_metadata(block_table, window, reqs)

    def __call__(self, q, k, v, cache: torch.Tensor, meta: CpuAttentionMetadata, scale: float,
                 softcap: float | None = None) -> torch.Tensor:
        return cpu_paged_attention(q, k, v, cache, meta, scale, softcap or 0.0)


class TritonAttention:
    """The Triton kernel: the CPU kernel's metadata (plus the longest query count, for the launch grid)."""

    reads_rows = True

    def __init__(self, block_size: int) -> None:
        from worker.ops import triton_attention  # triton is optional: imported only when this backend is chosen

        self.block_size = block_size
        self.ops = triton_attention

    def metadata(self, block_table: torch.Tensor, window: int | None,
                 reqs: StepRequests) -> "TritonAttentionMetadata":
        meta = kernel_metadata(block_table, window, reqs)
        return self.ops.TritonAttentionMetadata(**vars(meta), max_query_len=reqs.max_query_len)

    def __call__(self, q, k, v, cache: torch.Tensor, meta: "TritonAttentionMetadata", scale: float,
                 softcap: float | None = None) -> torch.Tensor:
        return self.ops.triton_paged_attention(q, k, v, cache, meta, scale, softcap or 0.0)


Attention = TorchAttention | CpuKernelAttention | TritonAttention
