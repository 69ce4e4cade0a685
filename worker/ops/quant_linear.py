"""Weight-only quantized linear layers: weights kept as low-bit codes, multiplied without a dense copy at decode
batch sizes, so a decode step reads a quarter (int4) or half (int8) of the bytes of bf16.

Int4Linear: codes 0..15 with a scale and a zero per group of 32 inputs, w = (q - 8) * scale + zero (GGUF Q4_0,
Q4_1 and Q4_K all take this form), kept in torch's packed int4 CPU layout and multiplied by torch's matmul for it,
or for fp32 activations by the extension's (torch's has no vectorized fp32 path on AVX2 CPUs), which reads them
blocked as w = q * scale + min (blocked_scale_min). Int8Linear: int8 codes with a
scale per group (GGUF Q8_0: 32; --quantization rtn: 128), multiplied by the extension's kernel. Larger batches
(prefill) dequantize the weight to the activation dtype in one pass of the extension and use the dense GEMM,
faster there than either kernel (the crossovers measured on SmolLM2-360M's shapes, one core: int4 about 16 rows,
int8 about 8)."""

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

INT4_GROUP = 32
INT4_MAX_ROWS = 16  # rows up to which the weight-only kernels beat dequantize + dense GEMM
INT8_MAX_ROWS = 8
_ROW_PAD = 64  # output rows padded to whole blocks of torch's int4 CPU packing (64 or 32 rows, by the CPU)


class Int4Linear:
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype):
        """q: [n, k] codes 0..15; scale, zero: [n, k / 32]. Rows are padded to a multiple of 64 (zero weights)."""
        self.n = q.shape[0]
        pad = -self.n % _ROW_PAD
        q, scale, zero = (F.pad(t, (0, 0, 0, pad)) for t in (q.to(torch.int32), scale.float(), zero.float()))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # [n_pad, k / 2] uint8
        self.order = int4_row_order()
        scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()  # [k / 32, n_pad, 2]
        self.bias = None if bias is None else bias.to(dtype)
        self.dtype = dtype
        self.ops = _extension()
        self.blocked = dtype == torch.float32 and self.ops is not None  # the extension's kernel multiplies
        # torch's (scale, zero) in the activation dtype, or the extension's blocked (scale, min)
        self.scales = blocked_scale_min(scale_zero, self.order.numel()) if self.blocked else scale_zero.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > INT4_MAX_ROWS:
            return F.linear(x, self.dequantize(), self.bias)
        if self.blocked:
            out = self.ops.int4_group_linear(x, self.packed, self.scales, self.order)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, INT4_GROUP, self.scales)
        if out.shape[1] != self.n:
            out = out[:, : self.n].contiguous()
        return out if self.bias is None else out + self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight [n, k] in the activation dtype (math in fp32, one rounding); from the extension, the
        transpose of a [k, n] tensor, which the GEMM reads as it is."""
        if self.ops is not None:
            return self.ops.int4_dequantize_t(self.packed, self.scales, self.order)[:, : self.n].t()
        return self.dequantize_torch()

    def dequantize_torch(self) -> torch.Tensor:
        n_pad, k = self.packed.shape[0], self.packed.shape[1] * 2
        q = unpack_int4(self.packed, self.order).view(n_pad, k // INT4_GROUP, INT4_GROUP)
        sz = self.scales.permute(1, 0, 2, 3).reshape(-1, n_pad, 2) if self.blocked else self.scales
        scale, offset = (sz[..., i].t().float().unsqueeze(-1) for i in (0, 1))
        w = (q.float() - (0 if self.blocked else 8)) * scale + offset
        return w.reshape(n_pad, k)[: self.n].to(self.dtype)


def blocked_scale_min(scale_zero: torch.Tensor, block: int) -> torch.Tensor:
    """Torch's [k / 32, n_pad, 2] (scale, zero), w = (q - 8) * scale + zero, as the extension's (scale, min),
    w = q * scale + min, blocked [n_pad / block, k / 32, block, 2]: a block of output rows reads its own in one
    sequential stream beside its codes (a decode step streams every weight from memory). In fp16 where that is exact
    (GGUF Q4_0 and Q4_1 store fp16 scales and mins): a sixth fewer bytes a weight."""
    scale, zero = scale_zero.float().unbind(-1)
    pairs = torch.stack([scale, zero - 8 * scale], dim=-1)
    groups, n_pad, _ = pairs.shape
    pairs = pairs.view(groups, n_pad // block, block, 2).permute(1, 0, 2, 3).contiguous()
    half = pairs.half()
    return half if torch.equal(half.float(), pairs) else pairs


@functools.cache
def int4_row_order() -> torch.Tensor:
    """Torch's packed int4 CPU layout on this CPU (int4mm_kernel.cpp), for the kernels that read it: a block of B
    output rows stores, for each input k, B / 2 bytes; entry 2j + h of the result is the row (within the block) of
    byte j's low (h 0) or high (h 1) nibble. AVX512: B 64, byte j holds rows j and j + 32; AVX2: B 32, rows j and
    j + 16; other CPUs: B 32, rows 2j and 2j + 1. Checked once against torch's packing of a probe."""
    block, interleaved = {"AVX512": (64, True), "AVX2": (32, True)}.get(torch.backends.cpu.get_cpu_capability(),
                                                                        (32, False))
    j = torch.arange(block // 2)
    order = (torch.stack([j, j + block // 2], 1) if interleaved else torch.stack([2 * j, 2 * j + 1], 1)).flatten()
    probe = torch.randint(0, 16, (_ROW_PAD, 2 * INT4_GROUP), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    if not torch.equal(unpack_int4(packed, order.int()), probe.to(torch.uint8)):
        raise RuntimeError(f"torch's packed int4 layout on this CPU ({torch.backends.cpu.get_cpu_capability()}) is not "
                           "one kvengine reads; serve the GGUF model with --quantization none")
    return order.int()


def unpack_int4(packed: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The codes [n_pad, k] (uint8, 0..15) of torch's packed int4 weight, whose blocks' byte order `order` gives."""
    n_pad, k, block = packed.shape[0], packed.shape[1] * 2, order.numel()
    slices = packed.view(n_pad // block, k, block // 2)
    nibbles = torch.stack([slices & 15, slices >> 4], dim=-1).view(n_pad // block, k, block)
    codes = torch.empty_like(nibbles)
    codes[..., order.long()] = nibbles
    return codes.transpose(1, 2).reshape(n_pad, k)


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
