"""A quantized paged KV cache (--kv-cache-dtype int8, fp8_e4m3, fp8_e5m2): one byte a value and one fp32 scale per
block, KV head and K/V, a value being code * scale.

The scale is chosen from the values as they are written: absmax / 127 for int8, for fp8 the power of two that
brings absmax within the format's largest value (a power of two changes no fp8 rounding). A write into a block
that already holds tokens of the request keeps the block's scale unless the new values need a larger one; then the
block's earlier codes are requantized to it (for fp8 an exact shift of the exponent, for int8 one more rounding).
The C++ and Triton kernels (worker/ops) write and read the same codes and scales; this module is the reference
they are tested against, in torch, used by the torch attention path.
"""

from dataclasses import dataclass

import torch

from protocol.kv_cache_spec import KVQuant

KV_QUANT_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}  # the largest code value


@dataclass(frozen=True)
class QuantizedKV:
    """One layer's quantized cache: block b of kv head h holds codes data[i, h, b] and scale scales[i, h, b]."""

    data: torch.Tensor  # [2, kv_heads, num_blocks, block_size, head_size], int8 or float8 codes (K then V)
    scales: torch.Tensor  # [2, kv_heads, num_blocks] fp32

    @property
    def quant(self) -> KVQuant:
        return "int8" if self.data.dtype == torch.int8 else "fp8_e4m3" if self.data.dtype == torch.float8_e4m3fn \
            else "fp8_e5m2"


KVCache = torch.Tensor | QuantizedKV  # a layer's cache: the model's dtype, or quantized


def block_scale(absmax: torch.Tensor, quant: KVQuant) -> torch.Tensor:
    """The smallest scale that holds absmax (fp32): absmax / 127, or for fp8 a power of two (0 for 0)."""
    ratio = absmax.float() / QMAX[quant]
    if quant == "int8":
        return ratio
    mantissa, exponent = torch.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
    return torch.ldexp(torch.ones_like(ratio), exponent - (mantissa == 0.5).int()) * (ratio > 0)


def quantize(x: torch.Tensor, scale: torch.Tensor, quant: KVQuant) -> torch.Tensor:
    """Codes of x (fp32) at scale (broadcast; 0 gives code 0): round to nearest even, clamped to the format."""
    y = torch.where(scale > 0, x / scale, 0.0).clamp(-QMAX[quant], QMAX[quant])
    return (y.round() if quant == "int8" else y).to(KV_QUANT_DTYPES[quant])


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale


def allocate(shape: tuple[int, ...], quant: KVQuant, zeros) -> QuantizedKV:
    """A zeroed quantized cache of shape [2, kv_heads, num_blocks, block_size, head_size]; zeros(shape, dtype)."""
    return QuantizedKV(zeros(shape, KV_QUANT_DTYPES[quant]), zeros(shape[:3], torch.float32))


def write_quantized(cache: QuantizedKV, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [tokens, kv_heads, head_size] written at their slots, tokens of a block in position order."""
    for i, x in enumerate((k, v)):
        _write_one(cache.data[i], cache.scales[i], x.float(), slots, cache.quant)


def _write_one(data: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, quant: KVQuant) -> None:
    """data [heads, blocks, block_size, hd], scales [heads, blocks], x [tokens, heads, hd] fp32."""
    heads, block_size, hd = data.shape[0], data.shape[2], data.shape[3]
    blocks, offsets = slots // block_size, slots % block_size
    touched, inv = torch.unique(blocks, return_inverse=True)
    absmax = torch.zeros(len(touched), heads, device=x.device).scatter_reduce(
        0, inv[:, None].expand(-1, heads), x.abs().amax(-1), "amax")
    start = torch.full((len(touched),), block_size, device=x.device).scatter_reduce(0, inv, offsets, "amin")
    old = scales[:, touched].T  # [touched, heads]; meaningful only where the block already holds tokens (start > 0)
    need = block_scale(absmax, quant)
    held = (start > 0)[:, None]
    new = torch.where(held, torch.maximum(old, need), need)
    grown = (held & (new > old)).T[:, :, None, None] & (torch.arange(block_size, device=x.device) < start[:, None])[
        None, :, :, None]  # [heads, touched, block_size, 1]: earlier codes to requantize
    raw = data.view(torch.uint8)  # torch copies and selects float8 tensors only as bytes
    if bool(grown.any()):
        codes = raw[:, touched]
        requantized = quantize(dequantize(codes.view(data.dtype), old.T[:, :, None, None]), new.T[:, :, None, None],
                               quant)
        raw[:, touched] = torch.where(grown, requantized.view(torch.uint8), codes)
    scales[:, touched] = new.T
    codes = quantize(x, new[inv][:, :, None], quant)
    raw.view(heads, -1, hd).index_copy_(1, slots, codes.view(torch.uint8).transpose(0, 1))


def gather_dequantized(cache: QuantizedKV, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """out [2, kv_heads, len(block_ids), block_size, head_size] (the model's dtype): the blocks' K and V, dequantized."""
    codes = cache.data.view(torch.uint8).index_select(2, block_ids).view(cache.data.dtype)
    scales = cache.scales.index_select(2, block_ids)
    out.copy_(dequantize(codes, scales[..., None, None]))


def resolve_kv_quant(kv_cache_dtype: str, dtype: torch.dtype) -> KVQuant:
    """--kv-cache-dtype as a spec's kv_quant ("": the model's dtype); fp8 is fp8_e4m3, as in vLLM."""
    if kv_cache_dtype == "auto":
        return ""
    if kv_cache_dtype == "bfloat16":
        if dtype != torch.bfloat16:
            raise ValueError(f"--kv-cache-dtype bfloat16 needs --dtype bfloat16 (the model runs in "
                             f"{str(dtype).removeprefix('torch.')}); an unquantized KV cache is in the model's dtype")
        return ""
    if kv_cache_dtype == "fp8":
        return "fp8_e4m3"
    if kv_cache_dtype not in KV_QUANT_DTYPES:
        raise ValueError(f"unsupported --kv-cache-dtype {kv_cache_dtype!r}")
    return kv_cache_dtype  # type: ignore[return-value]  # one of KVQuant's, checked above
