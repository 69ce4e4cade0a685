"""How a linear layer multiplies: every linear of the native models (attention, MLP, experts, LM head) gets its
weight here once, after tensor-parallel sharding, in the form its kernel reads.

Dense on the CPU: the weight reordered once into oneDNN's blocked layout (what mkldnn's matmul would otherwise
reorder on every call) and multiplied by oneDNN's prepacked linear: same results as F.linear within rounding,
faster at every batch size measured (docs/benchmarks.md). On CUDA, or where oneDNN has no kernel for the dtype
(fp16; bf16 on CPUs without AVX512BW/VL/DQ or AVX-NE-CONVERT, e.g. AVX2-only ones), F.linear. An fp32 weight whose
values are exact in bf16 or fp16 (a 16-bit checkpoint served in fp32) stays in 16 bits (HalfLinear). Quantized
weights (GGUF blocks kept at load, or --quantization rtn) go to worker/ops/quant_linear.py."""

import logging

import torch
import torch.nn.functional as F

from worker.model.gguf_quant import GGUFQuantTensor
from worker.ops.cpu_attention import CpuAttentionUnavailable, load_extension
from worker.ops.quant_linear import Int4Linear, Int8Linear

log = logging.getLogger(__name__)

LinearWeight = torch.Tensor | GGUFQuantTensor
RTN_GROUP = 128  # inputs per int8 scale, as vLLM's rtn; 32 where the input width is not a multiple of 128


class DenseLinear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        packed = _pack(weight)
        self.packed = packed is not None
        self.weight = weight if packed is None else packed  # the packed copy replaces the plain one
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")


class HalfLinear:
    """An fp32 model's weight whose values are all exact in bf16 (or fp16), as a 16-bit checkpoint's are: kept in
    16 bits and multiplied by the extension's kernel, which widens each value to fp32 in registers. Same math as
    DenseLinear (up to the order of fp32 additions), half the bytes read a call: faster at every batch size
    measured on an AVX2 CPU (docs/benchmarks.md)."""

    def __init__(self, weight: torch.Tensor, half: torch.dtype, bias: torch.Tensor | None, ops):
        self.n = weight.shape[0]
        self.weight = ops.half_pack(weight, half)
        self.bias, self.ops = bias, ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.half_linear(x, self.weight, self.n, self.bias)


Linear = DenseLinear | HalfLinear | Int4Linear | Int8Linear


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's prepacked copy of a CPU weight, or None where F.linear is the kernel."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    if not onednn_packs(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN reorders and multiplies weights of the dtype."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def make_linear(parts: list[LinearWeight], bias: torch.Tensor | None, quantization: str | None, dtype,
                device) -> Linear:
    """The linear of the weights parts stacked along the output rows (q, k, v; gate, up), this rank's shard."""
    bias = None if bias is None else bias.to(dtype=dtype, device=device)
    quantized = [p for p in parts if isinstance(p, GGUFQuantTensor)]
    if quantized and device.type == "cpu":
        kept = _gguf_linear(quantized, bias, dtype) if len(quantized) == len(parts) else None
        if kept is not None:
            return kept
        log.info("dequantizing %s at load: its parts differ in format (%s)", ", ".join(p.name for p in quantized),
                 ", ".join(p.qtype if isinstance(p, GGUFQuantTensor) else "dense" for p in parts))
    dense = [p.dequantize() if isinstance(p, GGUFQuantTensor) else p for p in parts]
    weight = torch.cat(dense).to(dtype=dtype, device=device)
    if quantization == "rtn":
        if device.type != "cpu":
            raise ValueError(f"--quantization rtn runs on the CPU, not on {device.type}")
        return Int8Linear(*rtn_int8(weight), bias, dtype)
    return _dense_linear(weight, bias)


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """HalfLinear where the weight is fp32 on the CPU, every value exact in 16 bits and the extension is built;
    DenseLinear otherwise."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu":
        return DenseLinear(weight, bias)
    half = next((d for d in (torch.bfloat16, torch.float16) if torch.equal(weight.to(d).float(), weight)), None)
    if half is None:
        return DenseLinear(weight, bias)
    try:
        return HalfLinear(weight, half, bias, load_extension())
    except CpuAttentionUnavailable:  # load_extension logged why
        return DenseLinear(weight, bias)


def _gguf_linear(parts: list[GGUFQuantTensor], bias: torch.Tensor | None, dtype) -> Linear | None:
    """Int4Linear for Q4_0 / Q4_1 / Q4_K parts, Int8Linear for Q8_0 ones; None for a mix of the two."""
    if all(p.qtype == "Q8_0" for p in parts):
        q, scale = (torch.cat(x) for x in zip(*(p.int8_form() for p in parts), strict=True))
        return Int8Linear(q, scale, bias, dtype)
    if all(p.qtype != "Q8_0" for p in parts):
        q, scale, zero = (torch.cat(x) for x in zip(*(p.int4_form() for p in parts), strict=True))
        return Int4Linear(q, scale, zero, bias, dtype)
    return None


def rtn_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 codes and a scale per group of inputs (max |w| / 127)."""
    n, k = weight.shape
    group = RTN_GROUP if k % RTN_GROUP == 0 else 32
    if k % group:
        raise ValueError(f"--quantization rtn needs input widths that are multiples of 32, not {k}")
    w = weight.float().view(n, k // group, group)
    scale = (w.abs().amax(dim=-1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.view(n, k), scale
