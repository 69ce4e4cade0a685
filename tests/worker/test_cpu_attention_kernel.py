"""The in-place CPU paged attention kernel against dense per-request attention (and the torch path).

The first test to run compiles the extension (once per machine; later runs load the cached build).
"""

import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from worker.attention import GatherBuffer, StepRequests, build_metadata, paged_attention
from worker.ops import cpu_attention
from worker.ops.cpu_attention import (
    CpuAttentionMetadata,
    CpuAttentionUnavailable,
    build_cpu_metadata,
    cpu_paged_attention,
    load_extension,
    paged_attention_cpu,
)

# (tokens already cached, tokens this step): decodes with short and long contexts, prefill chunks over a
# cached prefix (ending mid-block and on a block edge), a fresh prefill, a one-token "prefill" of a new request
MIXED = [(37, 1), (0, 45), (50, 30), (1, 1), (130, 1), (96, 32), (0, 1), (200, 17), (7, 1)]
BF16_TOL = 2**-8  # inputs rounded to bf16 (the reference sees the same), fp32 accumulation, output rounded to bf16


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


def run(b: Batch) -> torch.Tensor:
    out = cpu_paged_attention(b.q, b.k, b.v, b.cache, b.meta, b.q.shape[-1] ** -0.5)
    return out.view(b.q.shape)


def check(b: Batch, out: torch.Tensor) -> None:
    assert out.dtype == b.q.dtype
    tol = 1e-5 if out.dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.double(), b.expected, atol=tol, rtol=tol)


# bf16 on a CPU with AVX512-BF16 takes its scores by bf16 dot products: wide items (prefill tiles) and
# narrow ones (decodes, a kv head's group of q heads) each have their own path, for every head size.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 4), (8, 2), (16, 2), (32, 1)])
def test_gqa_ratios_and_head_sizes(heads, kv_heads, head_size, window, dtype):
    b = make_batch(MIXED, heads, kv_heads, head_size, 16, window, dtype)
    check(b, run(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("placement", ["scattered", "consecutive"])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_block_sizes_placements_windows_dtypes(block_size, placement, window, dtype):
    b = make_batch(MIXED, 8, 2, 32, block_size, window, dtype, placement)
    check(b, run(b))


# Narrow items (a few query rows) take one online-softmax step per span of blocks: contexts over many
# spans, windows that start mid-block and mid-span, 1 to 8 rows per item, a span of one block (128).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 130, 301])
@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 4), (16, 2)])
def test_narrow_items_over_many_spans(heads, kv_heads, block_size, window, dtype):
    b = make_batch([(300, 1), (517, 3), (1000, 2), (129, 1)], heads, kv_heads, 32, block_size, window, dtype)
    check(b, run(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [80, 96])  # 96: bf16 dot products at a run-time head size; 80: not whole 32s
def test_head_size_without_a_specialisation(head_size, dtype):
    b = make_batch(MIXED, 6, 3, head_size, 16, 33, dtype)
    check(b, run(b))


def test_long_prefill_chunk_over_a_long_prefix_on_two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        b = make_batch([(700, 300), (5, 1), (900, 1), (0, 260)], 8, 4, 64, 16, 256)
        check(b, run(b))
    finally:
        torch.set_num_threads(threads)


def test_sliding_window_reads_no_null_block():
    b = make_batch([(300, 1), (250, 40)], 4, 2, 32, 16, 32)
    assert (b.table[:, :10] == 0).all()  # the skipped blocks are null, and block 0 holds NaN
    assert torch.isnan(b.cache[:, :, 0]).all()
    out = run(b)
    assert not out.isnan().any()
    check(b, out)


def test_new_keys_land_at_their_slots():
    b = make_batch([(20, 3), (0, 17)], 4, 2, 32, 16)
    run(b)
    check_new_keys_landed(b)


def check_new_keys_landed(b: Batch) -> None:
    """After a run of make_batch([(20, 3), (0, 17)], 4, 2, 32, 16): each new K/V row is at its slot."""
    flat = b.cache.view(2, 2, -1, 32)
    for t, (r, p) in enumerate([(0, 20), (0, 21), (0, 22), *((1, p) for p in range(17))]):
        slot = int(b.table[r, p // 16]) * 16 + p % 16
        torch.testing.assert_close(flat[0, :, slot], b.k[t], rtol=0, atol=0)
        torch.testing.assert_close(flat[1, :, slot], b.v[t], rtol=0, atol=0)


def test_swapping_two_block_ids_changes_the_output():
    b = make_batch([(64, 1), (40, 8)], 4, 2, 32, 16)
    scale = 32**-0.5
    before = run(b)  # also writes the new tokens
    table = b.meta.block_table.clone()
    table[1, [0, 2]] = table[1, [2, 0]]  # request 1's queries at 40..47 now see other keys at positions 0..15
    after = paged_attention_cpu(b.q, b.cache, table, b.meta.query_start_loc, b.meta.seq_lens, -1, scale)
    after = after.view(b.q.shape)
    assert not torch.allclose(before[1:], after[1:])
    torch.testing.assert_close(before[:1], after[:1], rtol=0, atol=0)  # request 0 is untouched


def test_matches_the_torch_path():
    plan = [*MIXED, (60, 1), (80, 1), (33, 1)]  # the last three make a decode run there
    b = make_batch(plan, 8, 4, 32, 16, None, placement="scattered")
    counts, computed = torch.tensor([n for _, n in plan]), torch.tensor([c for c, _ in plan])
    rows = torch.arange(len(plan))
    reqs = StepRequests(
        rows=rows,
        num_computed=computed,
        num_scheduled=counts,
        query_start=torch.cumsum(counts, 0) - counts,
        positions=torch.cat([torch.arange(c, c + n) for c, n in plan]),
        token_rows=torch.repeat_interleave(rows, counts),
    )
    b.cache = b.cache.nan_to_num(0.0)  # the torch path reads whole blocks, unwritten slots included
    torch_cache = b.cache.clone()
    meta = build_metadata(b.table, 16, None, reqs, kv_bytes_per_token=2 * 4 * 32 * 4)
    buffer = GatherBuffer(1024, 4, 32, torch.float32, "cpu")
    expected = paged_attention(b.q, b.k, b.v, torch_cache, meta, buffer, 32**-0.5)
    assert any(s.num_reqs > 1 for s in meta.spans)  # decode runs, padded and masked, are among the spans
    torch.testing.assert_close(run(b).view(expected.shape), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.cache, torch_cache, rtol=0, atol=0)  # both wrote the same slots


def test_a_visible_null_block_is_refused():
    b = make_batch([(40, 1)], 4, 2, 32, 16)
    b.meta.block_table[0, 1] = 0
    with pytest.raises(RuntimeError, match="not a real block"):
        run(b)


def load_in_another_process() -> str:
    """load_extension() in a fresh interpreter; its log."""
    code = (
        "import logging; logging.basicConfig(level=logging.INFO);"
        "from worker.ops.cpu_attention import load_extension; load_extension()"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return done.stderr


def test_a_second_process_loads_the_cached_build():
    load_extension()
    assert "loaded the cached build" in load_in_another_process()


def test_a_build_lock_left_by_a_killed_build_is_removed():
    load_extension()
    lock = cpu_attention.build_directory() / "lock"
    lock.touch()  # as torch leaves it when its builder is killed mid-compile: a fresh one, nobody holding it
    log = load_in_another_process()
    assert "removing the build lock a killed build left" in log
    assert "loaded the cached build" in log
    assert not lock.exists()


def test_a_missing_compiler_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(CpuAttentionUnavailable, match="no C\\+\\+ compiler: 'no-such-compiler-here'"):
        cpu_attention._build()
