"""One KV block as bytes: the block's slice of every layer's cache, in layer order (a quantized cache's codes then
its scales), and back. Every cache tensor has the block index as its third dimension."""

import dataclasses

import torch


def cache_parts(kv_caches: list) -> list[torch.Tensor]:
    """The tensors of every layer's cache: the cache itself, or each tensor field of a quantized one."""
    parts = []
    for cache in kv_caches:
        if isinstance(cache, torch.Tensor):
            parts.append(cache)
        else:
            parts.extend(getattr(cache, f.name) for f in dataclasses.fields(cache))
    return parts


def block_nbytes(parts: list[torch.Tensor]) -> int:
    return sum(p[:, :, 0].numel() * p.element_size() for p in parts)


def copy_out(parts: list[torch.Tensor], block_id: int) -> torch.Tensor:
    """The block's bytes, a uint8 tensor on the CPU (a copy: the block may be reused once this returns). contiguous():
    reshape keeps a strided view where the slice's dimensions merge into one stride (a quantized cache's scales)."""
    return torch.cat([p[:, :, block_id].reshape(-1).contiguous().view(torch.uint8).cpu() for p in parts])


def copy_in(parts: list[torch.Tensor], block_id: int, payload: memoryview) -> None:
    """Write bytes made by copy_out into the block."""
    data = torch.frombuffer(payload, dtype=torch.uint8)
    offset = 0
    for p in parts:
        dst = p[:, :, block_id]
        n = dst.numel() * p.element_size()
        dst.copy_(data[offset : offset + n].view(p.dtype).view(dst.shape))
        offset += n
