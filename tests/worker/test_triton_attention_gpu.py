"""The Triton paged attention kernel compiled for a GPU (not the interpreter) against the torch path and dense
fp64 attention, on the mixed batches of the interpreter tests. Skipped without CUDA; bench/gpu_check.sh runs it
(in its own pytest run: test_triton_attention.py sets TRITON_INTERPRET=1 for the whole process)."""

import dataclasses
import importlib.util
import os

import pytest
import torch

from tests.worker.attention_support import MIXED, Batch, make_batch
from worker.attention import GatherBuffer, StepRequests, build_metadata, paged_attention

# triton is imported only inside the tests: test_triton_attention.py must set TRITON_INTERPRET before its first import
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                       reason="needs a CUDA device, without TRITON_INTERPRET (bench/gpu_check.sh)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                       reason="triton is an optional extra: pip install 'kvengine[cuda]'"),
]

HALF_TOL = 2e-2  # bf16 / fp16 inputs and output, fp32 accumulation: against dense fp64 attention


def on_cuda(b: Batch) -> Batch:
    meta = dataclasses.replace(b.meta, **{f: getattr(b.meta, f).cuda() for f in ("block_table", "query_start_loc",
                                                                                 "seq_lens")})
    return dataclasses.replace(b, q=b.q.cuda(), k=b.k.cuda(), v=b.v.cuda(), cache=b.cache.cuda(), meta=meta)


def triton_run(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's output (on the CPU) and the cache it wrote, for a CPU-built batch."""
    from worker.ops.triton_attention import TritonAttentionMetadata, triton_paged_attention

    g = on_cuda(b)
    counts = b.meta.query_start_loc[1:] - b.meta.query_start_loc[:-1]
    meta = TritonAttentionMetadata(**vars(g.meta), max_query_len=int(counts.max()))
    out = triton_paged_attention(g.q, g.k, g.v, g.cache, meta, b.q.shape[-1] ** -0.5)
    return out.view(b.q.shape).cpu(), g.cache.cpu()


def torch_path(b: Batch, plan, block_size, window) -> tuple[torch.Tensor, torch.Tensor]:
    cache = b.cache.nan_to_num(0.0)  # it reads whole blocks, unwritten slots included
    counts, computed = torch.tensor([n for _, n in plan]), torch.tensor([c for c, _ in plan])
    rows = torch.arange(len(plan))
    reqs = StepRequests(rows=rows, num_computed=computed, num_scheduled=counts,
                        query_start=torch.cumsum(counts, 0) - counts,
                        positions=torch.cat([torch.arange(c, c + n) for c, n in plan]),
                        token_rows=torch.repeat_interleave(rows, counts))
    kv_heads, hd = cache.shape[1], cache.shape[4]
    meta = build_metadata(b.table, block_size, window, reqs, kv_bytes_per_token=2 * kv_heads * hd * 4)
    out = paged_attention(b.q, b.k, b.v, cache, meta, GatherBuffer(1024, kv_heads, hd, b.q.dtype, "cpu"), hd**-0.5)
    return out.view(b.q.shape), cache


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(8, 8, 64), (16, 8, 128), (8, 1, 32)])
def test_mixed_batch_equals_the_torch_path_and_dense(heads, kv_heads, head_size, block_size, window):
    b = make_batch(MIXED, heads, kv_heads, head_size, block_size, window)
    expected, torch_cache = torch_path(b, MIXED, block_size, window)
    out, cache = triton_run(b)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), b.expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache.nan_to_num(0.0), torch_cache, rtol=0, atol=0)  # the same slots written


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    b = make_batch(MIXED, 16, 8, 128, 16, 40, dtype)
    out, _ = triton_run(b)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), b.expected, atol=HALF_TOL, rtol=HALF_TOL)
