"""Attention over the paged KV cache for a mixed batch of prefill chunks and decode tokens.

A layer's cache is one tensor `[2, num_blocks, block_size, kv_heads, head_size]` (K then V), so the
slot `block_id * block_size + offset` indexes `cache[i].view(-1, kv_heads, head_size)` directly.
Reading gathers a request's blocks into a preallocated buffer and runs SDPA there. Decode tokens
are gathered a few requests at a time so the buffer stays in the CPU cache while SDPA reads it
(measured: gathering all 64 x 1,024-token sequences at once costs 2.4x contiguous SDPA, chunks of
~8 MiB about 1.4x).
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

DECODE_CHUNK_BYTES = 8 << 20


@dataclass
class GatherSpan:
    """Requests whose K/V are gathered together: their tokens, blocks and key mask."""

    token_idx: torch.Tensor | None  # decode tokens of these requests; None for one prefill chunk
    token_range: tuple[int, int]  # the prefill chunk's [start, end) in the flattened batch
    block_ids: torch.Tensor  # [num_reqs * num_blocks] int64, flattened
    num_reqs: int
    num_blocks: int
    mask: torch.Tensor  # [num_reqs, 1, num_queries, num_blocks * block_size] bool, True = attend


@dataclass
class AttentionMetadata:
    """One KV cache group's view of the step, shared by all its layers."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    spans: list[GatherSpan] = field(default_factory=list)


@dataclass
class StepRequests:
    """Per scheduled request, in batch order (tensors on the device)."""

    rows: torch.Tensor  # block table row
    num_computed: torch.Tensor
    num_scheduled: torch.Tensor
    query_start: torch.Tensor
    positions: torch.Tensor  # [num_tokens]
    token_rows: torch.Tensor  # [num_tokens] block table row of each token


def build_metadata(
    table: torch.Tensor, block_size: int, window: int | None, reqs: StepRequests, kv_bytes_per_token: int
) -> AttentionMetadata:
    pos = reqs.positions
    blocks = table[reqs.token_rows, torch.div(pos, block_size, rounding_mode="floor")].long()
    meta = AttentionMetadata(slot_mapping=blocks * block_size + pos % block_size)
    is_decode = reqs.num_scheduled == 1
    decodes = torch.nonzero(is_decode).flatten().tolist()
    if decodes:
        meta.spans += _decode_spans(table, block_size, window, reqs, decodes, kv_bytes_per_token)
    for i in torch.nonzero(~is_decode).flatten().tolist():
        meta.spans.append(_prefill_span(table, block_size, window, reqs, i))
    return meta


def _first_block(first_query_pos: torch.Tensor, window: int | None, block_size: int) -> torch.Tensor:
    """First block any query can see: 0 for full attention, the window's start otherwise."""
    if window is None:
        return torch.zeros_like(first_query_pos)
    return torch.div((first_query_pos - window + 1).clamp(min=0), block_size, rounding_mode="floor")


def _gather_plan(table, block_size, rows, first_block, num_blocks):
    cols = (first_block.unsqueeze(1) + torch.arange(num_blocks, device=table.device)).clamp(max=table.shape[1] - 1)
    block_ids = table[rows.unsqueeze(1), cols].long().flatten()
    key_pos = first_block.unsqueeze(1) * block_size + torch.arange(num_blocks * block_size, device=table.device)
    return block_ids, key_pos


def _decode_spans(table, block_size, window, reqs, decodes, kv_bytes_per_token) -> list[GatherSpan]:
    idx = torch.tensor(decodes, device=table.device)
    qpos = reqs.num_computed[idx]
    first = _first_block(qpos, window, block_size)
    num_blocks = int((torch.div(qpos, block_size, rounding_mode="floor") - first).max()) + 1
    block_ids, key_pos = _gather_plan(table, block_size, reqs.rows[idx], first, num_blocks)
    visible = key_pos <= qpos.unsqueeze(1)
    if window is not None:
        visible &= key_pos > (qpos - window).unsqueeze(1)
    per_chunk = max(1, DECODE_CHUNK_BYTES // (num_blocks * block_size * kv_bytes_per_token))
    token_idx = reqs.query_start[idx]
    spans = []
    for s in range(0, len(decodes), per_chunk):
        e = min(s + per_chunk, len(decodes))
        spans.append(
            GatherSpan(
                token_idx=token_idx[s:e],
                token_range=(0, 0),
                block_ids=block_ids[s * num_blocks : e * num_blocks],
                num_reqs=e - s,
                num_blocks=num_blocks,
                mask=visible[s:e].view(e - s, 1, 1, -1),
            )
        )
    return spans


def _prefill_span(table, block_size, window, reqs, i) -> GatherSpan:
    nc, nq, start = int(reqs.num_computed[i]), int(reqs.num_scheduled[i]), int(reqs.query_start[i])
    first = _first_block(reqs.num_computed[i : i + 1], window, block_size)
    num_blocks = (nc + nq - 1) // block_size - int(first) + 1
    block_ids, key_pos = _gather_plan(table, block_size, reqs.rows[i : i + 1], first, num_blocks)
    qpos = torch.arange(nc, nc + nq, device=table.device).unsqueeze(1)
    visible = key_pos <= qpos
    if window is not None:
        visible &= key_pos > qpos - window
    return GatherSpan(None, (start, start + nq), block_ids, 1, num_blocks, visible.view(1, 1, nq, -1))


class GatherBuffer:
    """Preallocated, pre-touched scratch for gathered K and V, reused by every layer and step."""

    def __init__(self, max_tokens: int, num_kv_heads: int, head_size: int, dtype, device):
        shape = (2, max_tokens, num_kv_heads, head_size)
        self.data = torch.zeros(shape, dtype=dtype, device=device)

    def gather(self, cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, bs = block_ids.numel(), cache.shape[2]
        if n * bs > self.data.shape[1]:
            raise RuntimeError(f"gather of {n * bs} tokens exceeds the {self.data.shape[1]}-token buffer")
        k = self.data[0, : n * bs].view(n, bs, *cache.shape[3:])
        v = self.data[1, : n * bs].view(n, bs, *cache.shape[3:])
        torch.index_select(cache[0], 0, block_ids, out=k)
        torch.index_select(cache[1], 0, block_ids, out=v)
        return k, v


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    cache[0].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    cache[1].view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [tokens, heads, head_size]
    k: torch.Tensor,  # [tokens, kv_heads, head_size]
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    buffer: GatherBuffer,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V at their slots, then attend over cached + new tokens; [tokens, heads*head_size]."""
    write_kv(cache, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    heads, kv_heads, hd = q.shape[1], k.shape[1], q.shape[2]
    for span in meta.spans:
        kg, vg = buffer.gather(cache, span.block_ids)
        kg = kg.view(span.num_reqs, -1, kv_heads, hd).transpose(1, 2)
        vg = vg.view(span.num_reqs, -1, kv_heads, hd).transpose(1, 2)
        if span.token_idx is None:
            s, e = span.token_range
            qs = q[s:e].transpose(0, 1).unsqueeze(0)
        else:
            qs = q.index_select(0, span.token_idx).unsqueeze(2)
        o = F.scaled_dot_product_attention(qs, kg, vg, attn_mask=span.mask, scale=scale, enable_gqa=heads != kv_heads)
        if span.token_idx is None:
            out[s:e] = o[0].transpose(0, 1)
        else:
            out.index_copy_(0, span.token_idx, o.squeeze(2))
    return out.view(q.shape[0], -1)
