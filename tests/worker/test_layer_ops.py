"""The CPU extension's fused layer ops against the torch ops they replace (worker/model/layers.py)."""

import pytest
import torch
import torch.nn.functional as F

from protocol.model.rope_config import RopeConfig
from worker.model.layers import RMSNorm, silu_and_mul
from worker.model.rope import Rotary
from worker.ops.cpu_attention import load_extension

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: equal to a few ulp (other summation order); bf16: at most one bf16 step apart."""
    tol = dict(rtol=1e-6, atol=1e-6) if got.dtype == torch.float32 else dict(rtol=2**-7, atol=2**-7)
    torch.testing.assert_close(got, expected, **tol)


@pytest.fixture(scope="module")
def ops():
    return load_extension()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [256, 200])  # a multiple of the vector width, and one with a tail
def test_rms_norm_and_its_residual_form_match_torch(ops, dtype, hidden):
    g = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(37, hidden, generator=g).to(dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=g).to(dtype)
    reference, fused = RMSNorm(weight, 1e-6), RMSNorm(weight, 1e-6, ops)
    close(fused(x), reference(x))
    expected_x, expected_h = reference.add(x, delta)
    x_fused = x.clone()
    got_x, got_h = fused.add(x_fused, delta)
    assert got_x is x_fused  # updated in place
    assert torch.equal(got_x, expected_x)  # one rounded add, as torch's
    close(got_h, expected_h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_views_matches_torch(ops, dtype):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, hd = 8, 4, 32
    qkv = torch.randn(21, (heads + 2 * kv_heads) * hd, generator=g).to(dtype)
    positions = torch.randint(0, 500, (21,), generator=g)
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
    rope = RopeConfig(500000.0, hd, "llama3", scaling)
    reference, fused = (Rotary(rope, 512, "cpu", o) for o in (None, ops))
    q, k, _ = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    q, k = q.view(-1, heads, hd), k.view(-1, kv_heads, hd)
    expected = reference.apply(q, k, positions)
    got = fused.apply(q, k, positions)
    assert got[0].data_ptr() == q.data_ptr()  # rotated where it lies in the qkv output
    for a, b in zip(got, expected, strict=True):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same products and sums, unfused
        else:  # torch rounds cos, sin and each product to bf16; the kernel rounds once
            torch.testing.assert_close(a, b, rtol=2**-6, atol=2**-6)


def test_rotary_refuses_a_position_outside_its_table(ops):
    q, k = torch.zeros(2, 1, 32), torch.zeros(2, 1, 32)
    rotary = Rotary(RopeConfig(10000.0, 32), 16, "cpu", ops)
    with pytest.raises(RuntimeError, match="outside the table"):
        rotary.apply(q, k, torch.tensor([3, 16]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(ops, dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(33, 2 * 520, generator=g) * 6).to(dtype)  # large |x| on both sides, a tail past the vectors
    gate, up = x.chunk(2, dim=-1)
    close(silu_and_mul(x, ops), (F.silu(gate.float()).to(dtype) * up))
