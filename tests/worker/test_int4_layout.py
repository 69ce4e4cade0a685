"""Torch's packed int4 CPU layout differs by CPU (64-row blocks on AVX512, 32 on AVX2, adjacent row pairs on
others): the row order kvengine reads must match torch's packing under every capability this CPU can run, and the
extension's int4 kernels must read any of those orders."""

import os
import subprocess
import sys

import pytest
import torch

from worker.ops.cpu_attention import load_extension
from worker.ops.cpu_build import cpu_flags
from worker.ops.quant_linear import INT4_GROUP, blocked_scale_min, int4_row_order, unpack_int4

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAPABILITIES = {"default": set(), "avx2": {"avx2", "fma"}, "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"}}
PROBE = ("import torch\nfrom worker.ops.quant_linear import int4_row_order\n"
         "print(torch.backends.cpu.get_cpu_capability(), int4_row_order().numel())")


def orders() -> dict[str, torch.Tensor]:
    def interleaved(block):
        j = torch.arange(block // 2)
        return torch.stack([j, j + block // 2], 1).flatten().int()

    return {"avx512": interleaved(64), "avx2": interleaved(32), "default": torch.arange(32, dtype=torch.int32)}


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_row_order_matches_torch_packing(capability):
    """int4_row_order checks its order against torch's packing of a probe, and raises where they differ."""
    if not CAPABILITIES[capability] <= cpu_flags():
        pytest.skip(f"this CPU cannot run torch's {capability} kernels")
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "ATEN_CPU_CAPABILITY": capability}, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [capability.upper(), "64" if capability == "avx512" else "32"]


def test_native_order_is_one_of_the_known():
    assert any(torch.equal(int4_row_order(), o) for o in orders().values())


@pytest.mark.parametrize("layout", ["avx512", "avx2", "default"])
@pytest.mark.parametrize("fp16", [False, True], ids=["fp32-scales", "fp16-scales"])
def test_kernels_read_every_row_order(layout, fp16):
    """Random packed bytes in a layout: the extension's dequantize (torch's scales and zeros, and the blocked (scale,
    min) pairs) and its fp32 matmul against unpack_int4; scales and zeros fp16-exact or not."""
    order = orders()[layout]
    n_pad, k = 128, 96
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (n_pad, k // 2), dtype=torch.uint8, generator=g)
    scale_zero = torch.randn(k // INT4_GROUP, n_pad, 2, generator=g)
    if fp16:  # as a GGUF Q4_1 tensor's: zero = m + 8 d with d and m fp16
        scale_zero = scale_zero.half().float()
        scale_zero[..., 1] += 8 * scale_zero[..., 0]
    codes = unpack_int4(packed, order).float().view(n_pad, k // INT4_GROUP, INT4_GROUP)
    w = ((codes - 8) * scale_zero[..., 0].t()[..., None] + scale_zero[..., 1].t()[..., None]).view(n_pad, k)
    ops = load_extension()
    blocked = blocked_scale_min(scale_zero, order.numel())
    assert blocked.dtype == (torch.float16 if fp16 else torch.float32)
    for sz in (scale_zero, blocked):
        torch.testing.assert_close(ops.int4_dequantize_t(packed, sz, order).t(), w, rtol=1e-6, atol=1e-6)
    for m in (1, 3, 16):
        x = torch.randn(m, k, generator=g)
        torch.testing.assert_close(ops.int4_group_linear(x, packed, blocked, order), x @ w.t(), rtol=1e-5, atol=1e-4)


def test_blocked_scale_min_holds_each_block_in_order():
    """Entry [b, g, r] of the blocked form is (scale, zero - 8 scale) of torch's [g, b * block + r]."""
    scale_zero = torch.randn(3, 128, 2)
    blocked = blocked_scale_min(scale_zero, 32)
    assert blocked.shape == (4, 3, 32, 2) and blocked.is_contiguous() and blocked.dtype == torch.float32
    for b, g, r in ((0, 0, 0), (1, 2, 5), (3, 1, 31)):
        scale, zero = scale_zero[g, b * 32 + r]
        assert torch.equal(blocked[b, g, r], torch.stack([scale, zero - 8 * scale]))
