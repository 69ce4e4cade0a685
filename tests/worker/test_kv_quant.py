"""A quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2): the reference writer's scales and rounding,
the CPU kernel's writer against it bit for bit, the CPU kernel and the torch path reading the codes in place against
dense attention, the error each format brings, and the sizing (blocks per byte) the engine core plans with."""

import pytest
import torch

from engine_core.kv_cache.planning import capacity_line, get_kv_cache_config
from protocol.config import engine_config
from tests.worker.attention_support import MIXED
from tests.worker.kv_quant_support import (
    QUANT_ERROR_BOUND,
    QUANTS,
    QuantBatch,
    garbage_cache,
    quant_batch,
    reference_writer,
    step_requests,
    step_slots,
)
from worker.attention import GatherBuffer, build_metadata, paged_attention
from worker.kv_quant import QMAX, QuantizedKV, block_scale, dequantize, resolve_kv_quant, write_quantized
from worker.ops.cpu_attention import cpu_paged_attention, reshape_and_cache_cpu
from worker.worker import Worker

BF16_TOL = 2**-8  # as the unquantized kernel's: bf16 queries, fp32 accumulation, output rounded to bf16
HALF_TOL = 2e-2  # the torch path rounds the dequantized K/V and its probabilities to bf16 too


def cpu_writer(k, v, cache, meta, slots) -> None:
    reshape_and_cache_cpu(k, v, cache, meta)


def codes_and_scales(cache: QuantizedKV, slots: torch.Tensor):
    """The codes at these slots and the scales of their blocks, as bytes and floats."""
    heads, bs, hd = cache.data.shape[1], cache.data.shape[3], cache.data.shape[4]
    codes = cache.data.view(torch.uint8).view(2, heads, -1, hd)[:, :, slots]
    return codes, cache.scales[:, :, torch.unique(slots // bs)]


@pytest.mark.parametrize("quant", QUANTS)
def test_a_block_scale_holds_its_largest_value_and_fp8_scales_are_powers_of_two(quant):
    absmax = torch.tensor([0.0, 1e-3, 0.7, 3.0, 448.0, 5e4])
    s = block_scale(absmax, quant)
    assert s[0] == 0
    assert (absmax[1:] / s[1:] <= QMAX[quant] * (1 + 2**-23)).all()  # within an fp32 rounding (codes are clamped)
    if quant == "int8":
        torch.testing.assert_close(s, absmax / 127)
    else:
        assert (torch.frexp(s[1:]).mantissa == 0.5).all()  # a power of two ...
        assert (absmax[1:] / s[1:] > QMAX[quant] / 2).all()  # ... the smallest that holds absmax


@pytest.mark.parametrize("quant", QUANTS)
def test_a_larger_value_later_in_a_block_requantizes_its_earlier_codes(quant):
    cache = garbage_cache((2, 1, 3, 4, 2), quant)  # 3 blocks of 4 slots, 1 kv head of size 2
    first = torch.tensor([[[0.5, -0.25]], [[0.1, 0.2]]])  # 2 tokens at slots 4 and 5: block 1's first two
    write_quantized(cache, first, first, torch.tensor([4, 5]))
    before = dequantize(cache.data[:, 0, 1, :2], cache.scales[:, 0, 1, None, None])
    write_quantized(cache, torch.full((1, 1, 2), 8.0), torch.full((1, 1, 2), 8.0), torch.tensor([6]))
    assert (cache.scales[:, 0, 1] == block_scale(torch.tensor(8.0), quant)).all()  # grown for the new value
    after = dequantize(cache.data[:, 0, 1, :3], cache.scales[:, 0, 1, None, None])
    if quant == "int8":  # one more rounding, to the new scale's step
        torch.testing.assert_close(after[:, :2], before, atol=8.0 / 127, rtol=0)
    else:  # a power-of-two ratio: the exponent shifts, the mantissa stays
        assert torch.equal(after[:, :2], before)
    assert (after[:, 2] == 8.0).all()


@pytest.mark.parametrize("quant", QUANTS)
def test_a_fresh_block_ignores_the_scale_its_last_owner_left(quant):
    cache = garbage_cache((2, 1, 2, 4, 2), quant)
    cache.scales.fill_(1e6)  # a stale, far too large scale: kept, every small value would round to 0
    write_quantized(cache, torch.full((1, 1, 2), 0.5), torch.full((1, 1, 2), -0.5), torch.tensor([4]))
    torch.testing.assert_close(dequantize(cache.data[:, 0, 1, 0], cache.scales[:, 0, 1, None]),
                               torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))


@pytest.mark.parametrize("chunk", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", QUANTS)
def test_the_cpu_kernels_writer_equals_the_reference_bit_for_bit(quant, dtype, chunk):
    """Prefixes written a chunk at a time (decodes at chunk 1: a scale grows token by token), then the step."""
    ref = quant_batch(MIXED, 8, 2, 32, 16, quant, dtype=dtype, chunk=chunk)
    ker = quant_batch(MIXED, 8, 2, 32, 16, quant, dtype=dtype, chunk=chunk, writer=cpu_writer)
    cpu_paged_attention(ker.b.q, ker.b.k, ker.b.v, ker.cache, ker.b.meta, 32**-0.5)  # writes the step's K/V too
    write_quantized(ref.cache, ref.b.k, ref.b.v, step_slots(ref.b, MIXED))
    slots = _written_slots(ref)
    for got, want in zip(codes_and_scales(ker.cache, slots), codes_and_scales(ref.cache, slots), strict=True):
        assert torch.equal(got, want)


def _written_slots(qb: QuantBatch) -> torch.Tensor:
    bs = qb.b.cache.shape[3]
    return torch.tensor([int(qb.b.table[r, p // bs]) * bs + p % bs for r, (c, n) in enumerate(qb.plan)
                         for p in range(c + n)])


def run_kernel(qb: QuantBatch) -> torch.Tensor:
    b = qb.b
    return cpu_paged_attention(b.q, b.k, b.v, qb.cache, b.meta, b.q.shape[-1] ** -0.5).view(b.q.shape)


def run_torch_path(qb: QuantBatch, window) -> torch.Tensor:
    b = qb.b
    heads, bs, hd = b.cache.shape[1], b.cache.shape[3], b.cache.shape[4]
    meta = build_metadata(b.table, bs, window, step_requests(qb.plan), kv_bytes_per_token=2 * heads * hd * 4)
    buffer = GatherBuffer(2048, heads, hd, b.q.dtype, "cpu")
    return paged_attention(b.q, b.k, b.v, qb.cache, meta, buffer, hd**-0.5).view(b.q.shape)


# The kernel reads codes and scales in place for every path: wide items (prefill tiles) and narrow ones (decodes),
# compile-time head sizes (32, 64, 128) and a run-time one (80), GQA groups, windows; NaN scales and random codes in
# every block no request owns. Against dense attention over the same dequantized values: as tight as unquantized.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize(("heads", "kv_heads", "head_size"), [(8, 2, 32), (8, 4, 64), (16, 2, 128), (6, 3, 80)])
@pytest.mark.parametrize("quant", QUANTS)
def test_the_cpu_kernel_reads_the_codes_in_place(quant, heads, kv_heads, head_size, window, dtype):
    qb = quant_batch(MIXED, heads, kv_heads, head_size, 16, quant, window, dtype, writer=cpu_writer)
    out = run_kernel(qb)
    assert out.dtype == dtype and not out.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out.double(), qb.expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("placement", ["scattered", "consecutive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", QUANTS)
def test_the_torch_path_dequantizes_what_it_gathers(quant, dtype, placement):
    """The reference path, also over consecutive blocks (where unquantized it reads a view of the cache)."""
    qb = quant_batch(MIXED, 8, 2, 32, 16, quant, None, dtype, placement=placement)
    out = run_torch_path(qb, None)
    tol = 1e-5 if dtype == torch.float32 else HALF_TOL
    torch.testing.assert_close(out.double(), qb.expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("head_size", [32, 128])
@pytest.mark.parametrize("quant", QUANTS)
def test_a_float16_model(quant, head_size):
    qb = quant_batch(MIXED, 8, 2, head_size, 16, quant, 24, torch.float16, writer=cpu_writer)
    out = run_kernel(qb)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), qb.expected, atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("window", [None, 130])
@pytest.mark.parametrize("quant", QUANTS)
def test_narrow_items_over_many_spans(quant, window):
    plan = [(300, 1), (517, 3), (1000, 2), (129, 1)]
    qb = quant_batch(plan, 16, 2, 32, 16, quant, window, torch.bfloat16, writer=cpu_writer, chunk=64)
    torch.testing.assert_close(run_kernel(qb).double(), qb.expected, atol=BF16_TOL, rtol=BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quant", QUANTS)
def test_the_error_a_format_brings_stays_within_its_bound(quant, dtype):
    """Against dense attention over the original values (what an unquantized cache computes)."""
    qb = quant_batch(MIXED, 8, 2, 32, 16, quant, dtype=dtype, writer=cpu_writer, chunk=1)
    error = (run_kernel(qb).double() - qb.b.expected).abs().max().item()
    assert error <= QUANT_ERROR_BOUND[quant], error


def test_a_stale_scale_is_never_read():
    """Blocks nobody owns hold NaN scales (garbage_cache): a kernel that read one would output NaN."""
    qb = quant_batch([(40, 1), (0, 20)], 4, 2, 32, 16, "int8", writer=reference_writer)
    assert qb.cache.scales.isnan().any()
    assert not run_kernel(qb).isnan().any()


def test_kv_cache_dtype_names():
    assert resolve_kv_quant("auto", torch.float32) == ""
    assert resolve_kv_quant("bfloat16", torch.bfloat16) == ""
    assert resolve_kv_quant("fp8", torch.bfloat16) == "fp8_e4m3"  # as vLLM's fp8
    for quant in QUANTS:
        assert resolve_kv_quant(quant, torch.float32) == quant
    with pytest.raises(ValueError, match="--kv-cache-dtype bfloat16 needs --dtype bfloat16"):
        resolve_kv_quant("bfloat16", torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        engine_config(kv_cache_dtype="int4")


def blocks_for(kv_cache_dtype: str, budget: int) -> tuple[int, str]:
    w = Worker(engine_config(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=[budget],
                             max_model_len=512))
    report = w.report_kv()
    cfg = get_kv_cache_config(report.kv_cache_specs, [report.available_kv_bytes], 512, 2048)
    return cfg.num_blocks, capacity_line(cfg, 512, 2048)


@pytest.mark.parametrize("quant", QUANTS)
def test_the_same_memory_holds_at_least_1_9x_the_blocks_of_bfloat16(quant):
    """The built-in model (head size 32, the scales' largest share): 512 B of codes and 2 x 4 B of scales per K/V
    head and block, against 1,024 B of bf16."""
    budget = 64 << 20
    bf16_blocks, bf16_line = blocks_for("auto", budget)
    blocks, line = blocks_for(quant, budget)
    assert blocks >= 1.9 * bf16_blocks, (blocks, bf16_blocks)
    tokens = lambda text: int(text.split("KV cache size: ")[1].split(" tokens")[0].replace(",", ""))
    assert tokens(line) >= 1.9 * tokens(bf16_line)
