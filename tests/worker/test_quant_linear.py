"""The linear kernels against a dequantize-then-matmul reference: oneDNN's prepacked dense weights against
F.linear, and GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K weights kept quantized (int8 kernel, torch's packed int4 matmul, and
the dequantize + dense path of large batches), on every shape class: one row, a few, either side of the switch; output
widths that are not multiples of the kernels' row blocks (64) or grains (8), batches that are not multiples of
the int8 kernel's tile of 4 rows; one input block, an odd number, many.
Tensor-parallel shards of quantized weights split on block boundaries, or refused by name; --quantization rtn."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from worker.model.gguf_quant import GGUFQuantTensor
from worker.model.linear_method import DenseLinear, make_linear, onednn_packs, rtn_int8
from worker.ops.quant_linear import INT4_MAX_ROWS, INT8_MAX_ROWS, Int4Linear, Int8Linear

gguf = pytest.importorskip("gguf")

CPU = torch.device("cpu")
# decode, a small batch, both sides of each kernel's switch to dequantize + GEMM, a prefill
ROWS = (1, 5, INT8_MAX_ROWS, INT8_MAX_ROWS + 1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 40)
OUTPUTS = (64, 100, 7)  # a whole row block, a tail, fewer rows than one grain
# bf16: x rounded to bf16 is exact in the reference; scales/zeros rounded to bf16 (each up to 2^-9 relative, times
# codes up to 8) and the output's rounding (2^-9) leave at most a few parts in 10^3 of the output's scale
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def quant_tensor(qtype: str, n: int, k: int, seed: int = 0) -> GGUFQuantTensor:
    """Random weights in GGUF's blocks: quantized by the gguf package, or (Q4_K, which it cannot quantize) random
    codes and 6-bit scales under fixed super-block scales."""
    rng = np.random.default_rng(seed)
    if qtype != "Q4_K":
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.1
        return GGUFQuantTensor("w", qtype, gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]))
    data = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    data[..., 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    data[..., 2:4] = np.frombuffer(np.float16(0.003).tobytes(), np.uint8)
    return GGUFQuantTensor("w", qtype, data.reshape(n, -1))


def block_counts(qtype: str) -> list[int]:
    return [1, 3] if qtype == "Q4_K" else [1, 3, 8]  # one block, an odd count, several


def check(linear, weight: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    ref = x.double() @ weight.double().t() + (0 if bias is None else bias.double())
    out = linear(x)
    assert out.dtype == x.dtype and out.shape == ref.shape
    err = (out.double() - ref).abs().max().item()
    assert err <= TOLERANCE[x.dtype] * ref.abs().max().item(), (err, ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q4_K"])
def test_gguf_kernels_match_dequantize_then_matmul(qtype, dtype):
    elements = 256 if qtype == "Q4_K" else 32
    for n in OUTPUTS:
        for blocks in block_counts(qtype):
            t = quant_tensor(qtype, n, blocks * elements, seed=n + blocks)
            linear = make_linear([t], None, None, dtype, CPU)
            assert isinstance(linear, Int8Linear if qtype == "Q8_0" else Int4Linear)
            for m in ROWS:
                check(linear, t.dequantize(), torch.randn(m, t.shape[1]).to(dtype))


def test_kernel_forms_decode_exactly_as_gguf():
    for qtype in ("Q8_0", "Q4_0", "Q4_1", "Q4_K"):
        t = quant_tensor(qtype, 8, 512)
        if qtype == "Q8_0":
            q, scale = t.int8_form()
            w = q.float().view(8, -1, 32) * scale[..., None]
        else:
            q, scale, zero = t.int4_form()
            w = (q.float().view(8, -1, 32) - 8) * scale[..., None] + zero[..., None]
        assert torch.equal(w.view(8, 512), t.dequantize()), qtype


def test_int4_dequantize_undoes_torch_packing():
    """The prefill path reads torch's packed int4 layout back: equal to the codes it was given."""
    q = torch.randint(0, 16, (100, 96))
    scale, zero = torch.rand(100, 3), torch.randn(100, 3)
    w = (q.float().view(100, 3, 32) - 8) * scale[..., None] + zero[..., None]
    linear = Int4Linear(q, scale, zero, None, torch.float32)
    assert linear.ops is not None  # the extension's one-pass kernel, and the torch ops used without it
    w_min = q.float().view(100, 3, 32) * scale[..., None] + (zero - 8 * scale)[..., None]  # its w = q * scale + min
    assert torch.equal(linear.dequantize_torch(), w_min.view(100, 96))
    torch.testing.assert_close(linear.dequantize(), w.view(100, 96), rtol=1e-6, atol=1e-6)  # the kernel's FMA
    bf16 = Int4Linear(q, scale, zero, None, torch.bfloat16)
    torch.testing.assert_close(bf16.dequantize(), bf16.dequantize_torch(), rtol=2**-8, atol=1e-6)  # one bf16 step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parts_stack_and_bias(dtype):
    """q, k, v in one linear: Q4 formats mixed stay int4; Q8_0 beside Q4 is dequantized, with the same result."""
    parts = [quant_tensor("Q4_0", 64, 256, 1), quant_tensor("Q4_K", 32, 256, 2), quant_tensor("Q4_1", 40, 256, 3)]
    bias = torch.randn(136)
    weight = torch.cat([p.dequantize() for p in parts])
    linear = make_linear(parts, bias, None, dtype, CPU)
    assert isinstance(linear, Int4Linear)
    mixed = make_linear([parts[0], quant_tensor("Q8_0", 32, 256, 4)], None, None, dtype, CPU)
    assert isinstance(mixed, DenseLinear)
    for m in (1, 40):
        x = torch.randn(m, 256).to(dtype)
        check(linear, weight, x, bias.to(dtype).float())
        check(mixed, torch.cat([parts[0].dequantize(), quant_tensor("Q8_0", 32, 256, 4).dequantize()]), x)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K"])
def test_tensor_parallel_shards_on_block_boundaries(qtype):
    """Row-parallel shards (input columns) of two ranks sum to the whole; column-parallel shards (rows) stack."""
    k = 512
    t = quant_tensor(qtype, 96, k)
    x = torch.randn(3, k)
    whole = make_linear([t], None, None, torch.float32, CPU)(x)
    halves = [make_linear([t.narrow(1, r * k // 2, k // 2)], None, None, torch.float32, CPU)(x[:, r * k // 2:][:, :k // 2])
              for r in (0, 1)]
    # the same products summed in two parts: fp32 roundings of about sqrt(k) times the terms' magnitude
    terms = (x.abs() @ t.dequantize().abs().t()).max().item()
    torch.testing.assert_close(halves[0] + halves[1], whole, rtol=0, atol=torch.finfo(torch.float32).eps * k**0.5 * terms)
    rows = [make_linear([t.narrow(0, r * 48, 48)], None, None, torch.float32, CPU)(x) for r in (0, 1)]
    torch.testing.assert_close(torch.cat(rows, dim=1), whole)
    with pytest.raises(ValueError, match=r"w \(.*\) cannot be split at input columns 16\.\."):
        t.narrow(1, 16, 256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_dense_equals_f_linear(dtype):
    for n, k in ((100, 64), (2560, 96)):
        w, bias = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
        linear = DenseLinear(w, bias)
        assert linear.packed == onednn_packs(dtype) == linear.weight.is_mkldnn
        for m in (1, 7, 300):
            x = torch.randn(m, k).to(dtype)
            ref = F.linear(x, w, bias)
            # the same products summed in another order (fp32: about sqrt(k) roundings of the terms' magnitude),
            # rounded to the dtype (two roundings of the output's scale)
            terms = (x.abs().float() @ w.abs().float().t()).max().item()
            atol = torch.finfo(dtype).eps * (2 * ref.abs().max().item() + k**0.5 * terms)
            torch.testing.assert_close(linear(x), ref, rtol=0, atol=atol)


def test_onednn_packs_names_what_onednn_reorders():
    """bf16 weights are packed only where oneDNN has bf16 kernels (AVX512BW/VL/DQ or AVX-NE-CONVERT); elsewhere its
    reorder refuses them, and DenseLinear multiplies by F.linear instead of failing at load."""
    w = torch.randn(64, 32).bfloat16()
    if onednn_packs(torch.bfloat16):
        assert torch.ops.mkldnn._reorder_linear_weight(w).is_mkldnn
    else:
        with pytest.raises(RuntimeError, match="bf16 path needs"):
            torch.ops.mkldnn._reorder_linear_weight(w)
    assert onednn_packs(torch.float32) and not onednn_packs(torch.float16)


def test_dense_linear_without_onednn_kernel_is_f_linear(monkeypatch):
    monkeypatch.setattr("worker.model.linear_method.onednn_packs", lambda dtype: False)
    w, bias, x = torch.randn(48, 32).bfloat16(), torch.randn(48).bfloat16(), torch.randn(5, 32).bfloat16()
    linear = DenseLinear(w, bias)
    assert not linear.packed and linear.weight is w
    assert torch.equal(linear(x), F.linear(x, w, bias))


@pytest.mark.parametrize("k", [96, 256])
def test_rtn_int8(k):
    """Codes within half a step of the weight; the layer equals the matmul with its dequantized weight."""
    w = torch.randn(70, k)
    q, scale = rtn_int8(w)
    group = 128 if k % 128 == 0 else 32
    assert scale.shape == (70, k // group)
    deq = (q.float().view(70, -1, group) * scale[..., None]).view(70, k)
    assert ((deq - w).abs() <= scale.repeat_interleave(group, 1) / 2 + 1e-6).all()
    linear = make_linear([w], None, "rtn", torch.float32, CPU)
    assert isinstance(linear, Int8Linear)
    for m in ROWS:
        check(linear, deq, torch.randn(m, k))
