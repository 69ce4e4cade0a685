"""A quantized KV cache in Triton (worker/kv_quant.py is the reference): codes widened and scaled as the attention
kernel loads them, and the write kernel, which chooses each block's scale and rounds exactly as torch does.

fp8 codes are handled as bytes: read through their fp16 bit pattern (the sign, then the other 7 bits shifted into
place: exact for e5m2, 2^-8 of the value for e4m3), written by rounding the mantissa to nearest even by hand. So
neither the GPU nor Triton's interpreter needs fp8 support.
"""

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from worker.kv_quant import QuantizedKV

if TYPE_CHECKING:
    from worker.ops.triton_attention import TritonAttentionMetadata

QUANT_IDS = {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}


def code_tensor(kv: QuantizedKV) -> torch.Tensor:
    """The codes as the kernels take them: int8, or fp8 as bytes."""
    return kv.data if kv.data.dtype == torch.int8 else kv.data.view(torch.uint8)


@triton.jit
def dequantize_codes(codes, scale, QUANT: tl.constexpr):
    """Codes (int8, or fp8 as uint8) as fp32 values times scale."""
    if QUANT == 1:
        return codes.to(tl.float32) * scale
    c = codes.to(tl.int32)
    if QUANT == 2:
        h = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
        factor = 256.0
    else:
        h = ((c & 0x80) << 8) | ((c & 0x7F) << 8)
        factor = 1.0
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * (scale * factor)


@triton.jit
def _rint(x):
    """x rounded to the nearest integer, ties to even (fp32, |x| < 2^22)."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def _format(QUANT: tl.constexpr):
    """(largest value, smallest normal exponent, mantissa bits) of the format."""
    if QUANT == 1:
        return 127.0, 0, 0
    elif QUANT == 2:
        return 448.0, -6, 3
    else:
        return 57344.0, -14, 2


@triton.jit
def _block_scale(absmax, QUANT: tl.constexpr):
    """absmax / 127, or for fp8 the power of two at or above absmax / its largest value (0 for 0)."""
    qmax, _, _ = _format(QUANT)
    ratio = tl.div_rn(absmax, qmax)
    if QUANT == 1:
        return ratio
    bits = ratio.to(tl.int32, bitcast=True)
    up = ((bits & 0x7F800000) + 0x00800000).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x7FFFFF) == 0, ratio, up)


@triton.jit
def _to_codes(x, s, QUANT: tl.constexpr):
    """x (fp32) at scale s as codes: clamped to the format, rounded to nearest even."""
    qmax, emin, mbits = _format(QUANT)
    y = tl.where(s > 0, tl.div_rn(x, tl.where(s > 0, s, 1.0)), 0.0)
    y = tl.minimum(tl.maximum(y, -qmax), qmax)
    if QUANT == 1:
        return _rint(y).to(tl.int8)
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, emin)  # the exponent, subnormals at emin
    step = ((mbits - e + 127) << 23).to(tl.float32, bitcast=True)  # 2^(mbits - e): a's mantissa as an integer
    code = _rint(a * step).to(tl.int32) + (e - emin) * (1 << mbits)  # a carry to 2^(mbits+1) moves to the exponent
    sign = (y.to(tl.int32, bitcast=True) >> 31) & 1
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _write_block(x, stride_tok, codes, scales, code_offset, scale_offset, rows, slots, start, new, dims, dim_mask,
                 stride_slot, QUANT: tl.constexpr):
    """The new rows of one (K or V, kv head) into one block: its scale grown if they need it (the codes before
    start requantized to it), then their codes."""
    x = tl.load(x + rows[:, None] * stride_tok + dims[None, :], mask=new[:, None] & dim_mask[None, :], other=0.0)
    x = x.to(tl.float32)
    need = _block_scale(tl.max(tl.max(tl.abs(x), 1), 0), QUANT)
    old = tl.load(scales + scale_offset)
    s = tl.where(start > 0, tl.maximum(old, need), need)
    ptrs = codes + code_offset + slots[:, None] * stride_slot + dims[None, :]
    if (start > 0) & (s > old):
        earlier = (slots < start)[:, None] & dim_mask[None, :]
        held = tl.load(ptrs, mask=earlier, other=0)
        tl.store(ptrs, _to_codes(dequantize_codes(held, old, QUANT), s, QUANT), mask=earlier)
    tl.store(scales + scale_offset, s)
    tl.store(ptrs, _to_codes(x, s, QUANT), mask=new[:, None] & dim_mask[None, :])


@triton.jit
def _write_kv_quant_kernel(
    k, v, codes, scales, block_table, query_start_loc, seq_lens,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kv, stride_c_head, stride_c_block, stride_c_slot, stride_table, num_blocks,
    KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_P: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Program (request, kv head, j): the request's new tokens in the j-th block they reach."""
    req, kv_head, j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_begin = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_begin
    seq_len = tl.load(seq_lens + req)
    context = seq_len - q_len
    col = context // BLOCK_SIZE + j
    first = tl.maximum(context, col * BLOCK_SIZE)
    if first < seq_len:
        block_id = tl.load(block_table + req.to(tl.int64) * stride_table + col)
        slots = tl.arange(0, BLOCK_SIZE)
        dims = tl.arange(0, HEAD_P)
        pos = col * BLOCK_SIZE + slots
        new = (pos >= first) & (pos < seq_len)
        rows = (q_begin + pos - context).to(tl.int64)
        start = first - col * BLOCK_SIZE
        code_offset = kv_head.to(tl.int64) * stride_c_head + block_id.to(tl.int64) * stride_c_block
        scale_offset = kv_head * num_blocks + block_id
        _write_block(k + kv_head * stride_k_head, stride_k_tok, codes, scales, code_offset, scale_offset, rows, slots,
                     start, new, dims, dims < HEAD_SIZE, stride_c_slot, QUANT)
        _write_block(v + kv_head * stride_v_head, stride_v_tok, codes, scales, code_offset + stride_kv,
                     scale_offset + KV_HEADS * num_blocks, rows, slots, start, new, dims, dims < HEAD_SIZE,
                     stride_c_slot, QUANT)


def write_kv_quantized(k: torch.Tensor, v: torch.Tensor, kv: QuantizedKV, meta: "TritonAttentionMetadata") -> None:
    """This step's k, v [tokens, kv_heads, head_size] (rows contiguous) into a quantized cache."""
    codes = code_tensor(kv)
    kv_heads, num_blocks, block_size, head_size = codes.shape[1], codes.shape[2], codes.shape[3], codes.shape[4]
    grid = (len(meta.seq_lens), kv_heads, triton.cdiv(meta.max_query_len, block_size) + 1)
    _write_kv_quant_kernel[grid](
        k, v, codes, kv.scales, meta.block_table, meta.query_start_loc, meta.seq_lens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        codes.stride(0), codes.stride(1), codes.stride(2), codes.stride(3), meta.block_table.stride(0), num_blocks,
        KV_HEADS=kv_heads, BLOCK_SIZE=block_size, HEAD_SIZE=head_size, HEAD_P=max(16, triton.next_power_of_2(head_size)),
        QUANT=QUANT_IDS[kv.quant],
    )
