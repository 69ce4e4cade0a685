"""Paged attention against plain causal attention on each request's contiguous K/V."""

import pytest
import torch
import torch.nn.functional as F

from worker.attention import GatherBuffer, StepRequests, build_metadata, paged_attention

HEADS, KV_HEADS, HD, BS = 4, 2, 8, 4


def reference(q, k, v, window):
    """Causal (optionally sliding) attention over one whole sequence; q, k, v: [tokens, heads, hd]."""
    n = q.shape[0]
    pos = torch.arange(n)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, enable_gqa=True
    )
    return o.transpose(0, 1)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("placement", ["scattered", "consecutive"])
def test_mixed_batch_matches_contiguous_attention(window, placement):
    g = torch.Generator().manual_seed(0)
    # (tokens already cached, tokens this step): a decode, a prefill chunk after a prefix, a fresh prefill,
    # and two more decodes next to each other (a decode run when their blocks are scattered)
    plan = [(13, 1), (9, 5), (0, 7), (21, 1), (10, 1)]
    num_blocks = 64
    order = torch.randperm(num_blocks - 1, generator=g) + 1 if placement == "scattered" else torch.arange(1, num_blocks)
    table = torch.zeros(len(plan), 8, dtype=torch.int32)
    seqs, used = [], 0
    for r, (c, n) in enumerate(plan):
        nb = -(-(c + n) // BS)
        table[r, :nb] = order[used : used + nb].to(torch.int32)
        used += nb
        seqs.append([torch.randn(c + n, h, HD, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)])
    cache = torch.zeros(2, KV_HEADS, num_blocks, BS, HD)
    flat = cache.view(2, KV_HEADS, -1, HD)
    for r, (c, _) in enumerate(plan):  # the cached part, written where the block table says
        for p in range(c):
            slot = int(table[r, p // BS]) * BS + p % BS
            flat[0, :, slot], flat[1, :, slot] = seqs[r][1][p], seqs[r][2][p]
    counts = torch.tensor([n for _, n in plan])
    computed = torch.tensor([c for c, _ in plan])
    reqs = StepRequests(
        rows=torch.arange(len(plan)),
        num_computed=computed,
        num_scheduled=counts,
        query_start=torch.cumsum(counts, 0) - counts,
        positions=torch.cat([torch.arange(c, c + n) for c, n in plan]),
        token_rows=torch.repeat_interleave(torch.arange(len(plan)), counts),
    )
    meta = build_metadata(table, BS, window, reqs, kv_bytes_per_token=2 * KV_HEADS * HD * 4)
    assert any(s.num_reqs > 1 for s in meta.spans) == (placement == "scattered")
    assert any(s.first_block is not None for s in meta.spans) == (placement == "consecutive")
    new = [torch.cat([s[i][c:] for s, (c, _) in zip(seqs, plan, strict=True)]) for i in range(3)]
    out = paged_attention(*new, cache, meta, GatherBuffer(64, KV_HEADS, HD, torch.float32, "cpu"), HD**-0.5)
    expected = torch.cat([reference(*s, window)[c:] for s, (c, _) in zip(seqs, plan, strict=True)])
    torch.testing.assert_close(out.view(-1, HEADS, HD), expected)
