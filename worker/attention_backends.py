"""The two ways a layer attends over the paged cache; the runner picks one at start-up (--attention-backend).

Both take the same step (StepRequests and each group's block table) and the same layer inputs, write
this step's K/V at their slots and return [tokens, heads * head_size]:
- `cpu`: the C++ kernel of worker/ops, which reads K/V in place through the block table for the whole
  mixed batch (no gather, no padding);
- `torch`: gathers each request's K/V and calls SDPA; runs on any device and is the reference the
  kernel is tested against.
"""

import logging
from typing import Literal

import torch

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
    build_cpu_metadata,
    cpu_paged_attention,
    load_extension,
)

log = logging.getLogger(__name__)

BackendName = Literal["torch", "cpu"]


def resolve_backend(requested: str, device: torch.device) -> BackendName:
    """auto: the kernel on CPU (torch if it cannot be built here, with a warning), torch elsewhere.
    Loads (first use on this machine: compiles) the kernel now, so the cost falls in start-up."""
    if requested == "torch":
        return "torch"
    if device.type != "cpu":
        if requested == "cpu":
            raise ValueError(f"--attention-backend cpu runs on the CPU only, not on {device.type}")
        return "torch"
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

    def __init__(self, block_size: int, max_model_len: int, kv_heads: int, head_size: int, dtype, device) -> None:
        self.block_size = block_size
        self.kv_bytes_per_token = 2 * kv_heads * head_size * torch.finfo(dtype).bits // 8
        max_tokens = max(-(-max_model_len // block_size) * block_size, DECODE_CHUNK_BYTES // self.kv_bytes_per_token)
        self.buffer = GatherBuffer(max_tokens, kv_heads, head_size, dtype, device)

    def metadata(self, table: torch.Tensor, window: int | None, reqs: StepRequests) -> AttentionMetadata:
        return build_metadata(table, self.block_size, window, reqs, self.kv_bytes_per_token)

    def __call__(self, q, k, v, cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(q, k, v, cache, meta, self.buffer, scale)


class CpuKernelAttention:
    """The in-place C++ kernel; its metadata is the block table rows of the step's requests plus their lengths."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def metadata(self, table: torch.Tensor, window: int | None, reqs: StepRequests) -> CpuAttentionMetadata:
        return build_cpu_metadata(table, reqs.rows, reqs.num_computed, reqs.num_scheduled, self.block_size, window)

    def __call__(self, q, k, v, cache: torch.Tensor, meta: CpuAttentionMetadata, scale: float) -> torch.Tensor:
        return cpu_paged_attention(q, k, v, cache, meta, scale)


Attention = TorchAttention | CpuKernelAttention
