"""The in-place CPU paged attention kernel against dense per-request attention (and the torch path).

The first test to run compiles the extension (once per machine; later runs load the cached build).
"""

import pytest
import torch

from tests.worker.attention_support import MIXED, Batch, check_new_keys_landed, make_batch
from worker.attention import GatherBuffer, StepRequests, build_metadata, paged_attention
from worker.ops.cpu_attention import (
    cpu_paged_attention,
    paged_attention_cpu,
)

BF16_TOL = 2**-8  # inputs rounded to bf16 (the reference sees the same), fp32 accumulation, output rounded to bf16


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
