"""The Triton kernels over a quantized KV cache, run by Triton's interpreter on CPU tensors: the write kernel's codes
and scales equal the reference's (worker/kv_quant.py) bit for bit, and attention reads the codes in place within the
unquantized kernel's bounds of dense attention over the same dequantized values.

TRITON_INTERPRET=1 is set here, before triton is first imported, so the kernels run on the CPU.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton", reason="triton is an optional extra: pip install 'kvengine[cuda]'")

from tests.worker.kv_quant_support import QUANT_ERROR_BOUND, QUANTS, QuantBatch, quant_batch, step_slots
from worker.kv_quant import write_quantized
from worker.ops.triton_attention import TritonAttentionMetadata, triton_paged_attention, write_kv_triton

SMALL = [(37, 1), (0, 21), (50, 30), (1, 1), (70, 1), (32, 16), (0, 1), (90, 5), (7, 1)]
HALF_TOL = 2e-2  # as the unquantized Triton kernel's half-precision bound


def triton_meta(meta) -> TritonAttentionMetadata:
    counts = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    return TritonAttentionMetadata(**vars(meta), max_query_len=int(counts.max()))


def triton_writer(k, v, cache, meta, slots) -> None:
    write_kv_triton(k, v, cache, triton_meta(meta))


def run(qb: QuantBatch) -> torch.Tensor:
    b = qb.b
    return triton_paged_attention(b.q, b.k, b.v, qb.cache, triton_meta(b.meta), b.q.shape[-1] ** -0.5).view(b.q.shape)


@pytest.mark.parametrize(("plan", "chunk", "dtype"), [(SMALL, 7, torch.float32), ([(20, 1), (9, 3), (16, 2)], 1, torch.bfloat16)])
@pytest.mark.parametrize("quant", QUANTS)
def test_the_write_kernel_equals_the_reference_bit_for_bit(quant, dtype, plan, chunk):
    """Prefixes a chunk at a time (chunk 1: decodes, a block's scale grown token by token), then the step."""
    ref = quant_batch(plan, 4, 2, 32, 16, quant, dtype=dtype, chunk=chunk)
    tri = quant_batch(plan, 4, 2, 32, 16, quant, dtype=dtype, chunk=chunk, writer=triton_writer)
    run(tri)  # writes the step's K/V too
    write_quantized(ref.cache, ref.b.k, ref.b.v, step_slots(ref.b, plan))
    bs = 16
    slots = torch.tensor([int(ref.b.table[r, p // bs]) * bs + p % bs for r, (c, n) in enumerate(plan)
                          for p in range(c + n)])
    codes = [qb.cache.data.view(torch.uint8).view(2, 2, -1, 32)[:, :, slots] for qb in (tri, ref)]
    scales = [qb.cache.scales[:, :, torch.unique(slots // bs)] for qb in (tri, ref)]
    assert torch.equal(*codes)
    assert torch.equal(*scales)


# (the interpreter is slow: two shapes, each with its own window and dtype)
@pytest.mark.parametrize(("heads", "kv_heads", "window", "dtype"), [(8, 2, None, torch.float32), (8, 8, 24, torch.bfloat16)])
@pytest.mark.parametrize("quant", QUANTS)
def test_attention_reads_the_codes_in_place(quant, heads, kv_heads, window, dtype):
    """Random codes and NaN scales in every block no request owns: none may reach an output."""
    qb = quant_batch(SMALL, heads, kv_heads, 32, 16, quant, window, dtype, writer=triton_writer)
    out = run(qb)
    assert out.dtype == dtype and not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else HALF_TOL
    torch.testing.assert_close(out.double(), qb.expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("quant", QUANTS)
def test_the_error_a_format_brings_stays_within_its_bound(quant):
    qb = quant_batch(SMALL, 8, 2, 32, 16, quant, writer=triton_writer, chunk=3)
    error = (run(qb).double() - qb.b.expected).abs().max().item()
    assert error <= QUANT_ERROR_BOUND[quant], error
