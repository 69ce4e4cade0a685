"""Attention over the paged KV cache for a mixed batch of prefill chunks and decode tokens.

A layer's cache is one tensor `[2, kv_heads, num_blocks, block_size, head_size]` (K then V): the
slot `block_id * block_size + offset` indexes `cache[i].view(kv_heads, -1, head_size)` directly, and
gathering a request's blocks along dim 1 gives `[kv_heads, tokens, head_size]`, the layout SDPA
reads fastest (measured here: token-major `[tokens, kv_heads, head_size]` made SDPA 1.75x slower).
A prefill chunk, or a decode token with a long context, gathers exactly the keys it can see into a
preallocated buffer (no mask for a decode). Decode tokens with short contexts are batched, padded
and masked, in runs of up to DECODE_CHUNK_BYTES of gathered K/V: one SDPA call per request costs
~0.1 ms of overhead, which dominates when contexts are short. A request whose blocks are consecutive
ids (common: a fresh pool hands them out in order) is read through a view of the cache, no copy.
A quantized cache (worker/kv_quant.py, the reference for the kernels) is written with its scales and
gathered dequantized into the same buffer, always through the gather.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from worker.kv_quant import KVCache, QuantizedKV, gather_dequantized, write_quantized

DECODE_CHUNK_BYTES = 2 << 20


@dataclass
class Span:
    """Queries [q_start, q_end) of one request, or of a run of decode requests (one token each)."""

    q_start: int
    q_end: int
    block_ids: torch.Tensor  # int64, per request the blocks from its first visible key to its last token
    num_reqs: int
    key_offset: int = 0  # one request: first visible key within the first gathered block
    first_block: int | None = None  # one request whose blocks are consecutive ids: read a view, no gather
    num_keys: int = 0
    mask: torch.Tensor | None = None  # True = attend; [queries, keys], or [reqs, 1, 1, keys] for a run
    causal: bool = False  # plain causal mask (queries and keys start together)


@dataclass
class AttentionMetadata:
    """One KV cache group's view of the step, shared by all its layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    spans: list[Span]


@dataclass
class StepRequests:
    """Per scheduled request, in batch order (tensors on the device)."""

    rows: torch.Tensor  # block table row
    num_computed: torch.Tensor
    num_scheduled: torch.Tensor
    query_start: torch.Tensor
    positions: torch.Tensor  # [num_tokens]
    token_rows: torch.Tensor  # [num_tokens] block table row of each token
    # The in-place kernels' view, from the runner's persistent buffers (the torch path does not read it); a
    # CUDA graph batch has padding requests after the real ones, one token each.
    query_start_loc: torch.Tensor | None = None  # [reqs + 1] int32: first query row of each request, then the total
    seq_lens: torch.Tensor | None = None  # [reqs] int32: num_computed + num_scheduled
    max_query_len: int = 0


class RequestKeys(NamedTuple):
    """One scheduled request's keys and queries this step, as host ints."""

    key_start: int  # first visible key (token position)
    key_end: int  # one past the last key: num_computed + num_queries
    first_block: int  # block table column of key_start
    num_blocks: int  # block table columns from first_block to the last key
    num_computed: int
    num_queries: int
    query_start: int  # first query's row in the step's tokens


def build_metadata(
    table: torch.Tensor, block_size: int, window: int | None, reqs: StepRequests, kv_bytes_per_token: int
) -> AttentionMetadata:
    pos = reqs.positions
    blocks = table[reqs.token_rows, torch.div(pos, block_size, rounding_mode="floor")].long()
    slot_mapping = blocks * block_size + pos % block_size
    nc, nq = reqs.num_computed, reqs.num_scheduled
    key_start = torch.zeros_like(nc) if window is None else (nc - window + 1).clamp(min=0)
    key_end = nc + nq
    # With a window this is kv_cache_spec.num_skipped_blocks, on tensors: the null blocks before it are never read.
    first_block = torch.div(key_start, block_size, rounding_mode="floor")
    num_blocks = torch.div(key_end - 1, block_size, rounding_mode="floor") - first_block + 1
    cols = first_block.unsqueeze(1) + torch.arange(int(num_blocks.max()), device=table.device)
    block_ids = table[reqs.rows.unsqueeze(1), cols.clamp(max=table.shape[1] - 1)].long()
    consecutive = _consecutive(block_ids, num_blocks).tolist()
    columns = (key_start, key_end, first_block, num_blocks, nc, nq, reqs.query_start)
    per_req = [RequestKeys(*r) for r in zip(*(t.tolist() for t in columns), strict=True)]
    spans, i = [], 0
    budget = DECODE_CHUNK_BYTES // (block_size * kv_bytes_per_token)  # blocks per decode run
    while i < len(per_req):
        run = _decode_run_length(per_req, consecutive, i, budget)
        if run > 1:
            spans.append(_decode_run(block_ids[i : i + run], per_req[i : i + run], key_start, key_end, block_size, i))
        else:
            spans.append(_single(block_ids[i, : per_req[i].num_blocks], per_req[i], window, block_size))
            if consecutive[i]:
                spans[-1].first_block = int(block_ids[i, 0])
        i += run
    return AttentionMetadata(slot_mapping, spans)


def _decode_run_length(per_req: list[RequestKeys], consecutive: list[bool], i: int, budget: int) -> int:
    """How many decode requests from i on to batch: scattered ones only, padded blocks within budget."""
    run = 0
    while i + run < len(per_req) and per_req[i + run].num_queries == 1 and not consecutive[i + run]:
        if (run + 1) * max(r.num_blocks for r in per_req[i : i + run + 1]) > budget:
            break
        run += 1
    return max(run, 1)


def _consecutive(block_ids: torch.Tensor, num_blocks: torch.Tensor) -> torch.Tensor:
    """Per request: are its blocks consecutive ids (as a fresh pool hands them out)?"""
    steps = block_ids[:, 1:] - block_ids[:, :-1] == 1
    inside = torch.arange(steps.shape[1], device=steps.device) < (num_blocks - 1).unsqueeze(1)
    return (steps | ~inside).all(dim=1)


def _single(block_ids, r: RequestKeys, window, block_size) -> Span:
    span = Span(
        r.query_start,
        r.query_start + r.num_queries,
        block_ids,
        1,
        key_offset=r.key_start - r.first_block * block_size,
        num_keys=r.key_end - r.key_start,
    )
    if r.num_queries > 1 and window is None and r.num_computed == 0:
        span.causal = True
    elif r.num_queries > 1:
        span.mask = _visible(r.num_computed, r.num_queries, r.key_start, r.key_end, window, block_ids.device)
    return span


def _decode_run(block_ids, rows: list[RequestKeys], key_start, key_end, block_size, first) -> Span:
    """Decode tokens of consecutive requests: blocks padded to the longest, keys masked per request."""
    n, nb = len(rows), max(r.num_blocks for r in rows)
    kpos = torch.tensor([r.first_block for r in rows], device=block_ids.device).unsqueeze(1) * block_size
    kpos = kpos + torch.arange(nb * block_size, device=block_ids.device)
    visible = (kpos >= key_start[first : first + n, None]) & (kpos < key_end[first : first + n, None])
    q0 = rows[0].query_start
    return Span(q0, q0 + n, block_ids[:, :nb].flatten(), n, mask=visible.view(n, 1, 1, -1))


def _visible(num_computed, num_queries, key_start, key_end, window, device) -> torch.Tensor:
    qpos = torch.arange(num_computed, num_computed + num_queries, device=device).unsqueeze(1)
    kpos = torch.arange(key_start, key_end, device=device)
    visible = kpos <= qpos
    if window is not None:
        visible &= kpos > qpos - window
    return visible


class GatherBuffer:
    """Preallocated, pre-touched scratch for one request's gathered K and V, reused by every layer and step."""

    def __init__(self, max_tokens: int, num_kv_heads: int, head_size: int, dtype, device):
        self.data = torch.zeros(2, num_kv_heads, max_tokens, head_size, dtype=dtype, device=device)

    def gather(self, cache: KVCache, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these blocks, each [kv_heads, len(block_ids) * block_size, head_size]; a quantized cache's
        dequantized."""
        shape = cache.data.shape if isinstance(cache, QuantizedKV) else cache.shape
        n, bs = block_ids.numel(), shape[3]
        if n * bs > self.data.shape[2]:
            raise RuntimeError(f"gather of {n * bs} tokens exceeds the {self.data.shape[2]}-token buffer")
        if isinstance(cache, QuantizedKV):
            kv = self.data[:, :, : n * bs].view(2, shape[1], n, bs, shape[4])
            gather_dequantized(cache, block_ids, kv)
            return kv[0].view(shape[1], n * bs, -1), kv[1].view(shape[1], n * bs, -1)
        k = self.data[0, :, : n * bs].view(cache.shape[1], n, bs, cache.shape[4])
        v = self.data[1, :, : n * bs].view(cache.shape[1], n, bs, cache.shape[4])
        torch.index_select(cache[0], 1, block_ids, out=k)
        torch.index_select(cache[1], 1, block_ids, out=v)
        return k.view(cache.shape[1], n * bs, -1), v.view(cache.shape[1], n * bs, -1)


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v: [tokens, kv_heads, head_size] written at their slots (quantized where the cache is)."""
    if isinstance(cache, QuantizedKV):
        return write_quantized(cache, k, v, slots)
    heads, hd = cache.shape[1], cache.shape[4]
    cache[0].view(heads, -1, hd).index_copy_(1, slots, k.transpose(0, 1))
    cache[1].view(heads, -1, hd).index_copy_(1, slots, v.transpose(0, 1))


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_size]
    k: torch.Tensor,  # [tokens, kv_heads, head_size]
    v: torch.Tensor,
    cache: KVCache,
    meta: AttentionMetadata,
    buffer: GatherBuffer,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Write this step's K/V at their slots, then attend over cached + new tokens; [tokens, heads*head_size].
    softcap: scaled scores capped to softcap * tanh(score / softcap) before the softmax."""
    write_kv(cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for span in meta.spans:
        if span.first_block is None or isinstance(cache, QuantizedKV):
            kg, vg = buffer.gather(cache, span.block_ids)
        else:
            blocks = slice(span.first_block, span.first_block + span.block_ids.numel())
            kg = cache[0][:, blocks].view(cache.shape[1], -1, cache.shape[4])
            vg = cache[1][:, blocks].view(cache.shape[1], -1, cache.shape[4])
        if span.num_reqs > 1:  # a decode run: [reqs, kv_heads, keys, head_size], queries [reqs, heads, 1, hd]
            kg = kg.view(kg.shape[0], span.num_reqs, -1, kg.shape[2]).transpose(0, 1)
            vg = vg.view(vg.shape[0], span.num_reqs, -1, vg.shape[2]).transpose(0, 1)
            qs = q[span.q_start : span.q_end].unsqueeze(2)
        else:
            keys = slice(span.key_offset, span.key_offset + span.num_keys)
            kg, vg = kg[:, keys].unsqueeze(0), vg[:, keys].unsqueeze(0)
            qs = q[span.q_start : span.q_end].transpose(0, 1).unsqueeze(0)
        if softcap is None:
            o = F.scaled_dot_product_attention(
                qs, kg, vg, attn_mask=span.mask, is_causal=span.causal, scale=scale, enable_gqa=gqa
            )
        else:
            o = softcapped_attention(qs, kg, vg, span, scale, softcap)
        out[span.q_start : span.q_end] = o.squeeze(2) if span.num_reqs > 1 else o[0].transpose(0, 1)
    return out.view(q.shape[0], -1)


def softcapped_attention(q, k, v, span: Span, scale: float, softcap: float) -> torch.Tensor:
    """SDPA with each scaled score s capped to softcap * tanh(s / softcap) (as transformers' eager attention does it:
    softmax in fp32, then cast); q [b, heads, queries, hd], k and v [b, kv_heads, keys, hd]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) * scale / softcap) * softcap
    visible = span.mask
    if span.causal:
        visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
