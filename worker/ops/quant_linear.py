"""Weight-only quantized linear layers: weights kept as low-bit codes, multiplied without a dense copy at decode
batch sizes, so a decode step reads a quarter (int4) or half (int8) of the bytes of bf16.

Int4Linear: codes 0..15 with a scale and a zero per group of 32 inputs, w = (q - 8) * scale + zero (GGUF Q4_0,
Q4_1 and Q4_K all take this form), multiplied by torch's packed int4 CPU matmul. Int8Linear: int8 codes with a
scale per group (GGUF Q8_0: 32; --quantization rtn: 128), multiplied by the extension's kernel. Larger batches
(prefill) dequantize the weight to the activation dtype in one pass of the extension and use the dense GEMM,
faster there than either kernel (the crossovers measured on SmolLM2-360M's shapes, one core: int4 about 16 rows,
int8 about 8)."""

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

INT4_GROUP = 32
INT4_MAX_ROWS = 16  # rows up to which the weight-only kernels beat dequantize + dense GEMM
INT8_MAX_ROWS = 8
_ROW_BLOCK = 64  # torch's int4 CPU packing interleaves blocks of 64 output rows


class Int4Linear:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype):
        """q: [n, k] codes 0..15; scale, zero: [n, k / 32]. Rows are padded to a multiple of 64 (zero weights)."""
        self.n = q.shape[0]
        pad = -self.n % _ROW_BLOCK
        q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q.to(torch.int32), scale.float(), zero.float()))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [n_pad, k / 2] uint8
        self.scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()  # [k / 32, n_pad, 2]
        self.bias = None if bias is None else bias.to(dtype)
        self.dtype = dtype
        self.ops = _extension()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT4_MAX_ROWS:
            return F.linear(x, self.dequantize(), self.bias)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, INT4_GROUP, self.scale_zero)
        if out.shape[1] != self.n:
            out = out[:, : self.n].contiguous()
        return out if self.bias is None else out + self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight [n, k] in the activation dtype (math in fp32, one rounding); from the extension, the
        transpose of a [k, n] tensor, which the GEMM reads as it is."""
        if self.ops is not None:
            return self.ops.int4_dequantize_t(self.packed, self.scale_zero)[:, : self.n].t()
        return self.dequantize_torch()

    def dequantize_torch(self) -> torch.Tensor:
        n_pad, k = self.packed.shape[0], self.packed.shape[1] * 2
        blocks = self.packed.view(n_pad // _ROW_BLOCK, k, _ROW_BLOCK // 2)  # byte j: rows j (low) and j + 32 (high)
        q = torch.cat([blocks & 15, blocks >> 4], dim=2).transpose(1, 2).reshape(n_pad, k // INT4_GROUP, INT4_GROUP)
        scale, zero = (self.scale_zero[..., i].t().float().unsqueeze(-1) for i in (0, 1))
        w = (q.float() - 8) * scale + zero
        return w.reshape(n_pad, k)[: self.n].to(self.dtype)


class Int8Linear:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        """q: [n, k] int8; scale: [n, k / group] (float32 in memory: the kernel's fp32 sums take it as is)."""
        self.q, self.scale = q.to(torch.int8).contiguous(), scale.float().contiguous()
        self.group = q.shape[1] // scale.shape[1]
        self.bias = None if bias is None else bias.to(dtype)
        self.dtype = dtype
        self.ops = _extension()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT8_MAX_ROWS or self.ops is None:
            return F.linear(x, self.dequantize(), self.bias)
        out = self.ops.int8_group_linear(x, self.q, self.scale)
        return out if self.bias is None else out + self.bias

    def dequantize(self) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.int8_dequantize(self.q, self.scale, self.dtype)
        n, k = self.q.shape
        w = self.q.view(n, k // self.group, self.group).float() * self.scale.unsqueeze(-1)
        return w.view(n, k).to(self.dtype)


def _extension():
    """The CPU extension's kernels, or None: then int8 weights dequantize at every batch size, and both dequantize
    with torch ops (correct, slower)."""
    from worker.ops.cpu_attention import CpuAttentionUnavailable, load_extension

    try:
        return load_extension()
    except CpuAttentionUnavailable as e:
        log.warning("int8 weight-only matmul without the CPU extension (%s): every batch dequantizes", e)
        return None
