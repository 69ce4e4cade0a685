"""The attention batches the paged attention kernel tests share, with their dense fp64 reference (no tests here)."""

from dataclasses import dataclass

import torch

from worker.ops.cpu_attention import CpuAttentionMetadata, build_cpu_metadata

# (tokens already cached, tokens this step): decodes with short and long contexts, prefill chunks over a
# cached prefix (ending mid-block and on a block edge), a fresh prefill, a one-token "prefill" of a new request
MIXED = [(37, 1), (0, 45), (50, 30), (1, 1), (130, 1), (96, 32), (0, 1), (200, 17), (7, 1)]


@dataclass
class Batch:
    q: torch.Tensor  # [tokens, heads, hd]: this step's queries
    k: torch.Tensor  # [tokens, kv_heads, hd]: this step's new keys (not yet in the cache)
    v: torch.Tensor
    cache: torch.Tensor
    table: torch.Tensor  # [num_reqs, max_blocks] int32
    meta: CpuAttentionMetadata
    expected: torch.Tensor  # [tokens, heads, hd] fp64, dense attention over each whole sequence


def skipped_blocks(num_computed: int, window: int | None, block_size: int) -> int:
    return 0 if window is None else max(0, num_computed - window + 1) // block_size


def make_batch(plan, heads, kv_heads, hd, bs, window=None, dtype=torch.float32, placement="scattered", seed=0):
    """Cached K/V written where the table says; every block nobody owns, and the null block 0, hold NaN."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // bs) for c, n in plan]
    num_blocks = sum(need) + 3
    ids = torch.randperm(num_blocks - 1, generator=g) + 1 if placement == "scattered" else torch.arange(1, num_blocks)
    table = torch.zeros(len(plan), max(need) + 2, dtype=torch.int32)
    cache = torch.full((2, kv_heads, num_blocks, bs, hd), float("nan"), dtype=dtype)
    flat = cache.view(2, kv_heads, -1, hd)
    used, qs, ks, vs, expected = 0, [], [], [], []
    for r, (c, n) in enumerate(plan):
        skip = skipped_blocks(c, window, bs)  # blocks that left the window are the null block, as the ledger has them
        table[r, skip : need[r]] = ids[used : used + need[r] - skip].to(torch.int32)
        used += need[r] - skip
        q, k, v = (torch.randn(c + n, h, hd, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
        for p in range(skip * bs, c):
            slot = int(table[r, p // bs]) * bs + p % bs
            flat[0, :, slot], flat[1, :, slot] = k[p], v[p]
        qs.append(q[c:])
        ks.append(k[c:])
        vs.append(v[c:])
        expected.append(dense(q, k, v, window)[c:])
    rows, computed = torch.arange(len(plan)), torch.tensor([c for c, _ in plan])
    meta = build_cpu_metadata(table, rows, computed, torch.tensor([n for _, n in plan]), bs, window)
    return Batch(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, table, meta, torch.cat(expected))


def dense(q, k, v, window):
    """Causal (optionally sliding) attention over one whole sequence in fp64; q, k, v: [tokens, heads, hd]."""
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    pos = torch.arange(n)
    visible = pos[None, :] <= pos[:, None]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    scores = (q @ k.transpose(1, 2)) * q.shape[-1] ** -0.5
    return (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)


def check_new_keys_landed(b: Batch) -> None:
    """After a run of make_batch([(20, 3), (0, 17)], 4, 2, 32, 16): each new K/V row is at its slot."""
    flat = b.cache.view(2, 2, -1, 32)
    for t, (r, p) in enumerate([(0, 20), (0, 21), (0, 22), *((1, p) for p in range(17))]):
        slot = int(b.table[r, p // 16]) * 16 + p % 16
        torch.testing.assert_close(flat[0, :, slot], b.k[t], rtol=0, atol=0)
        torch.testing.assert_close(flat[1, :, slot], b.v[t], rtol=0, atol=0)
