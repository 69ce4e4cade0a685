"""HalfLinear: an fp32 model's weights whose values are exact in bf16 or fp16 kept in 16 bits, multiplied by the
extension's kernel. Against an fp64 reference on every shape class the kernel has: one and two rows (two sums a
column), 3-5 rows, whole tiles of 6 and a tail, a batch of many x-row blocks; output widths under one panel, a
panel's tail, several panels; input widths of 1, odd, and long. make_linear picks it only where the values are
exact, and what it keeps is the weight in 16 bits."""

import pytest
import torch

from worker.model.linear_method import DenseLinear, HalfLinear, make_linear
from worker.ops.cpu_attention import load_extension

CPU = torch.device("cpu")
ROWS = (1, 2, 3, 5, 6, 7, 13, 300)
SHAPES = ((1, 1), (7, 33), (37, 5), (100, 96), (64, 2560))  # (n, k)


def fp32_bound(x: torch.Tensor, w: torch.Tensor, k: int) -> float:
    """The fp32 rounding of k products summed in any order: about sqrt(k) roundings of the terms' magnitude."""
    terms = (x.abs().double() @ w.abs().double().t()).max().item()
    return 4 * torch.finfo(torch.float32).eps * k**0.5 * terms


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_linear_matches_fp64(half):
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g).to(half)
        bias = torch.randn(n, generator=g)
        for with_bias in (False, True):
            linear = make_linear([w], bias if with_bias else None, None, torch.float32, CPU)
            assert isinstance(linear, HalfLinear) and linear.weight.dtype == half
            for m in ROWS:
                x = torch.randn(m, k, generator=g)
                ref = x.double() @ w.double().t() + (bias.double() if with_bias else 0)
                out = linear(x)
                assert out.dtype == torch.float32 and out.shape == (m, n)
                err = (out.double() - ref).abs().max().item()
                assert err <= fp32_bound(x, w, k) + 1e-12, (n, k, m, with_bias, err)


def test_half_linear_equals_dense_fp32():
    """The same weights, kept in bf16 or widened to a packed fp32 copy: the same products in another order."""
    w = torch.randn(1600, 960).bfloat16()
    half, dense = make_linear([w], None, None, torch.float32, CPU), DenseLinear(w.float(), None)
    assert isinstance(half, HalfLinear)
    for m in (1, 8, 64):
        x = torch.randn(m, 960)
        torch.testing.assert_close(half(x), dense(x), rtol=0, atol=2 * fp32_bound(x, w, 960))


def test_make_linear_keeps_16_bits_only_where_exact():
    """A bf16 checkpoint's parts stacked (q, k, v) in a float32 model: kept as bf16, two bytes a value; values exact
    in fp16 but not in bf16: fp16; any other fp32 weight, or a model in bf16: dense as before."""
    parts = [torch.randn(64, 48).bfloat16(), torch.randn(16, 48).bfloat16()]
    stacked = make_linear(parts, None, None, torch.float32, CPU)
    assert isinstance(stacked, HalfLinear) and stacked.weight.dtype == torch.bfloat16 and stacked.n == 80
    assert stacked.weight.numel() * stacked.weight.element_size() == 2 * stacked.weight.numel()
    x = torch.randn(2, 3, 48)  # leading dims kept
    torch.testing.assert_close(stacked(x), x @ torch.cat(parts).float().t(), rtol=0, atol=1e-4)
    fp16_only = torch.full((8, 8), 1 + 2**-10)  # 11 significant bits: an fp16, not a bf16
    assert make_linear([fp16_only], None, None, torch.float32, CPU).weight.dtype == torch.float16
    assert isinstance(make_linear([torch.randn(8, 8)], None, None, torch.float32, CPU), DenseLinear)
    assert isinstance(make_linear([torch.randn(8, 8).bfloat16()], None, None, torch.bfloat16, CPU), DenseLinear)


def test_half_linear_refuses_what_it_cannot_multiply():
    ops = load_extension()
    packed = ops.half_pack(torch.randn(20, 16), torch.bfloat16)
    with pytest.raises(RuntimeError, match="half_linear: fp32 x"):
        ops.half_linear(torch.randn(2, 16).bfloat16(), packed, 20)
    with pytest.raises(RuntimeError, match="half_linear: the weight as half_pack packs it"):
        ops.half_linear(torch.randn(2, 17), packed, 20)
    with pytest.raises(RuntimeError, match="half_linear: the weight as half_pack packs it"):
        ops.half_linear(torch.randn(2, 16), packed, 20 + packed.shape[2])
    with pytest.raises(RuntimeError, match="half_linear: fp32 bias"):
        ops.half_linear(torch.randn(2, 16), packed, 20, torch.randn(19))
    with pytest.raises(RuntimeError, match="half_pack: a 2-d weight"):
        ops.half_pack(torch.randn(20, 16), torch.float32)
    assert torch.equal(ops.half_linear(torch.zeros(0, 16), packed, 20), torch.zeros(0, 20))
    ones = ops.half_pack(torch.ones(20, 16), torch.bfloat16)
    assert torch.equal(ops.half_linear(torch.ones(1, 16), ones, 20), torch.full((1, 20), 16.0))
