"""Paged attention in Triton: one launch for a whole mixed batch, K/V read in place through the block table.

Same inputs and semantics as the CPU kernel (worker/ops/paged_attention.cpp): the cache is
`[2, kv_heads, num_blocks, block_size, head_size]` (K then V), request r's key at position p lives in
block `block_table[r, p // block_size]` at offset `p % block_size`, and a query at position p sees keys
`[max(0, p - window + 1), p]` (window -1: `[0, p]`); softcap > 0 caps each scaled score s to
`softcap * tanh(s / softcap)` (Gemma 2).

A program handles one (request, kv head, tile of the request's queries); its rows are the tile's query
tokens times the q heads that share the kv head, so a decode reads each K/V block once for its whole GQA
group. It walks only the cache blocks its rows can see, one block per step, with an online softmax in
fp32; keys outside [first visible key, last query] are masked at the load, so null blocks (before a
sliding window) and unwritten slots are never read. Under TRITON_INTERPRET=1 it runs on CPU tensors.

A quantized cache (worker/kv_quant.py: int8 or fp8 codes, one fp32 scale per K/V, kv head and block) is read
in place too: each block's codes are widened and scaled as they are loaded; fp8 codes are read as bytes and
widened through their fp16 bit pattern, so no fp8 support is needed from the GPU or the interpreter. The
write kernel (kv_quant_triton.py) rounds as torch does.
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.kv_quant import KVCache, QuantizedKV
from worker.ops.cpu_attention import CpuAttentionMetadata
from worker.ops.kv_quant_triton import QUANT_IDS, code_tensor, dequantize_codes, write_kv_quantized

TILE_ROWS = 64  # query rows (tokens x q heads of one kv head) per program


@dataclass
class TritonAttentionMetadata(CpuAttentionMetadata):
    """The CPU kernel's metadata plus the longest query count, which sizes the launch grid."""

    max_query_len: int = 0


@triton.jit
def _query_span(query_start_loc, seq_lens, req, tile, TOKENS: tl.constexpr):
    """First query row of the request, its query count, its first query's position, this tile's first token."""
    q_begin = tl.load(query_start_loc + req)
    q_len = tl.load(query_start_loc + req + 1) - q_begin
    seq_len = tl.load(seq_lens + req)
    return q_begin, q_len, seq_len - q_len, tile * TOKENS


@triton.jit
def _load_block(cache, kv_offset, block_id, stride_block, stride_slot, stride_dim, slots, dims, visible_key, dim_mask):
    """One cache block's K or V as [block_size, HEAD]; slots whose key is outside the visible range are 0, unread."""
    ptrs = cache + kv_offset + block_id.to(tl.int64) * stride_block + slots[:, None] * stride_slot + dims[None, :] * stride_dim
    return tl.load(ptrs, mask=visible_key[:, None] & dim_mask[None, :], other=0.0)


@triton.jit
def _load_kv(cache, scales, kv_offset, kv_head, block_id, stride_kv, stride_block, stride_slot, stride_dim, slots, dims,
             visible_key, dim_mask, kv_heads, num_blocks, QUANT: tl.constexpr, DTYPE: tl.constexpr):
    """A block's K and V as [block_size, HEAD] in DTYPE (quantized: dequantized by the block's scales)."""
    k = _load_block(cache, kv_offset, block_id, stride_block, stride_slot, stride_dim, slots, dims, visible_key, dim_mask)
    v = _load_block(cache, kv_offset + stride_kv, block_id, stride_block, stride_slot, stride_dim, slots, dims,
                    visible_key, dim_mask)
    if QUANT:
        k = dequantize_codes(k, tl.load(scales + kv_head * num_blocks + block_id), QUANT).to(DTYPE)
        v = dequantize_codes(v, tl.load(scales + (kv_heads + kv_head) * num_blocks + block_id), QUANT).to(DTYPE)
    return k, v


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b, accumulated in fp32. UPCAST: multiply in fp32 (exact for bf16 products); Triton's interpreter
    multiplies bf16 operands as their raw bits."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _paged_attention_kernel(
    out, q, cache, scales, block_table, query_start_loc, seq_lens,
    scale, window, softcap, num_blocks,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_kv, stride_c_head, stride_c_block, stride_c_slot, stride_c_dim,
    stride_table,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, TOKENS: tl.constexpr, KV_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_P: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, SOFTCAP: tl.constexpr, QUANT: tl.constexpr,
):
    req, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_begin, q_len, context, t0 = _query_span(query_start_loc, seq_lens, req, tile, TOKENS)
    if t0 < q_len:
        rows = tl.arange(0, TOKENS * GROUP_P)
        token = t0 + rows // GROUP_P
        head = kv_head * GROUP + rows % GROUP_P
        row_mask = (token < q_len) & (rows % GROUP_P < GROUP)
        dims = tl.arange(0, HEAD_P)
        dim_mask = dims < HEAD_SIZE
        q_rows = (q_begin + token).to(tl.int64) * stride_q_tok + head * stride_q_head
        q_tile = tl.load(q + q_rows[:, None] + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        pos = context + token  # each row's query position

        # The keys any row of the tile sees: from the first row's window start to the last row's position.
        last_pos = context + tl.minimum(t0 + TOKENS, q_len) - 1
        first_key = tl.where(window > 0, tl.maximum(context + t0 - window + 1, 0), 0)
        kv_offset = kv_head.to(tl.int64) * stride_c_head
        slots = tl.arange(0, BLOCK_SIZE)
        m = tl.full([TOKENS * GROUP_P], float("-inf"), tl.float32)
        denom = tl.zeros([TOKENS * GROUP_P], tl.float32)
        acc = tl.zeros([TOKENS * GROUP_P, HEAD_P], tl.float32)
        for col in range(first_key // BLOCK_SIZE, last_pos // BLOCK_SIZE + 1):
            block_id = tl.load(block_table + req.to(tl.int64) * stride_table + col)
            key = col * BLOCK_SIZE + slots
            in_range = (key >= first_key) & (key <= last_pos)
            k, v = _load_kv(cache, scales, kv_offset, kv_head, block_id, stride_kv, stride_c_block, stride_c_slot,
                            stride_c_dim, slots, dims, in_range, dim_mask, KV_HEADS, num_blocks, QUANT, q_tile.dtype)
            scores = _dot(q_tile, tl.trans(k), PRECISION, UPCAST) * scale
            if SOFTCAP:  # softcap * tanh(scores / softcap), tanh from exp(-2|y|)
                y = scores / softcap
                e = tl.exp(-2.0 * tl.abs(y))
                t = (1.0 - e) / (1.0 + e)
                scores = tl.where(y < 0, -t, t) * softcap
            seen = (key[None, :] <= pos[:, None]) & in_range[None, :]
            seen = seen & ((key[None, :] > pos[:, None] - window) | (window <= 0))
            scores = tl.where(seen, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0
            p = tl.exp(scores - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            denom = denom * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
            m = m_new

        result = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        o_rows = (q_begin + token).to(tl.int64) * stride_o_tok + head * stride_o_head
        tl.store(out + o_rows[:, None] + dims[None, :], result.to(out.dtype.element_ty),
                 mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit
def _write_kv_kernel(
    k, v, cache, block_table, query_start_loc, seq_lens,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_kv, stride_c_head, stride_c_block, stride_c_slot, stride_c_dim,
    stride_table,
    TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_P: tl.constexpr,
):
    """This step's k, v [tokens, kv_heads, head_size] at their slots: request r's token i is at position context + i."""
    req, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_begin, q_len, context, t0 = _query_span(query_start_loc, seq_lens, req, tile, TOKENS)
    if t0 < q_len:
        token = t0 + tl.arange(0, TOKENS)
        dims = tl.arange(0, HEAD_P)
        mask = (token < q_len)[:, None] & (dims < HEAD_SIZE)[None, :]
        pos = context + token
        block_id = tl.load(block_table + req.to(tl.int64) * stride_table + pos // BLOCK_SIZE, mask=token < q_len, other=0)
        dst = (kv_head.to(tl.int64) * stride_c_head + block_id.to(tl.int64) * stride_c_block
               + (pos % BLOCK_SIZE) * stride_c_slot)[:, None] + dims[None, :] * stride_c_dim
        rows = (q_begin + token).to(tl.int64)[:, None]
        k_tile = tl.load(k + rows * stride_k_tok + kv_head * stride_k_head + dims[None, :], mask=mask)
        v_tile = tl.load(v + rows * stride_v_tok + kv_head * stride_v_head + dims[None, :], mask=mask)
        tl.store(cache + dst, k_tile, mask=mask)
        tl.store(cache + stride_kv + dst, v_tile, mask=mask)


def _padded(head_size: int) -> int:
    return max(16, triton.next_power_of_2(head_size))  # tl.dot needs every dimension >= 16


def _cache_strides(cache: torch.Tensor) -> tuple[int, ...]:
    return cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), cache.stride(4)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: TritonAttentionMetadata) -> None:
    """Write this step's k, v [tokens, kv_heads, head_size] at the slots the block table gives (quantized where the
    cache is)."""
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    if isinstance(cache, QuantizedKV):
        return write_kv_quantized(k, v, cache, meta)
    tokens = 16
    grid = (len(meta.seq_lens), cache.shape[1], triton.cdiv(meta.max_query_len, tokens))
    _write_kv_kernel[grid](
        k, v, cache, meta.block_table, meta.query_start_loc, meta.seq_lens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *_cache_strides(cache), meta.block_table.stride(0),
        TOKENS=tokens, BLOCK_SIZE=cache.shape[3], HEAD_SIZE=cache.shape[4], HEAD_P=_padded(cache.shape[4]),
    )


def paged_attention_triton(
    q: torch.Tensor, kv: KVCache, meta: TritonAttentionMetadata, scale: float,
    block_table: torch.Tensor | None = None, softcap: float = 0.0,
) -> torch.Tensor:
    """q [tokens, heads, head_size] over the cache read in place; returns [tokens, heads * head_size].
    block_table replaces meta's (tests swap block ids with it)."""
    table = meta.block_table if block_table is None else block_table
    if isinstance(kv, QuantizedKV):
        cache, scales, quant = code_tensor(kv), kv.scales, QUANT_IDS[kv.quant]
    else:
        cache, scales, quant = kv, kv, 0  # scales unread
    if q.stride(2) != 1:
        q = q.contiguous()
    heads, kv_heads, head_size, block_size = q.shape[1], cache.shape[1], cache.shape[4], cache.shape[3]
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"the Triton attention kernel needs a power-of-two block size >= 16, not {block_size}")
    group = heads // kv_heads
    group_p = triton.next_power_of_2(group)
    tokens = max(1, TILE_ROWS // group_p)
    out = torch.empty(q.shape[0], heads, head_size, dtype=q.dtype, device=q.device)
    grid = (len(meta.seq_lens), kv_heads, triton.cdiv(meta.max_query_len, tokens))
    _paged_attention_kernel[grid](
        out, q, cache, scales, table, meta.query_start_loc, meta.seq_lens,
        scale, meta.window, softcap, cache.shape[2],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *_cache_strides(cache), table.stride(0),
        GROUP=group, GROUP_P=group_p, TOKENS=tokens, KV_HEADS=kv_heads,
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, HEAD_P=_padded(head_size),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1",
        SOFTCAP=softcap > 0, QUANT=quant,
    )
    return out.view(q.shape[0], -1)


def triton_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: TritonAttentionMetadata, scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The layer's attention: write this step's K/V, then attend over cached + new keys; [tokens, heads*head_size]."""
    write_kv_triton(k, v, cache, meta)
    return paged_attention_triton(q, cache, meta, scale, softcap=softcap)
