"""Soft-capped attention (Gemma 2: each scaled score s becomes c * tanh(s / c) before the softmax) on the three
attention paths, against transformers' Gemma 2 eager attention on the same queries, keys and values.

TRITON_INTERPRET=1 is set before triton is first imported, so the Triton kernel runs on the CPU.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace

import pytest
import torch

from tests.worker.attention_support import Batch, make_batch
from worker.attention import GatherBuffer, StepRequests, build_metadata, paged_attention
from worker.ops.cpu_attention import cpu_paged_attention

transformers = pytest.importorskip("transformers")

PLAN = [(37, 1), (0, 21), (50, 30), (1, 1), (70, 1), (7, 1)]  # decodes, a fresh prefill, a chunk over a prefix
HEADS, KV_HEADS, HD, BS = 8, 2, 32, 16
SCALE, CAP = 0.3, 2.0  # scores of std ~1.7 against a cap of 2: most are bent


def full_sequence(b: Batch, r: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Request r's keys and values over its whole sequence: cached ones read back through the table (zero where
    the window has let them go: never visible), then this step's."""
    c, n = PLAN[r]
    start = sum(m for _, m in PLAN[:r])
    flat = b.cache.view(2, KV_HEADS, -1, HD)
    kv = torch.zeros(2, c, KV_HEADS, HD, dtype=b.cache.dtype)
    first = 0 if window is None else max(0, c - window + 1) // BS * BS
    for p in range(first, c):
        slot = int(b.table[r, p // BS]) * BS + p % BS
        kv[:, p] = flat[:, :, slot]
    return torch.cat([kv[0], b.k[start : start + n]]), torch.cat([kv[1], b.v[start : start + n]])


def transformers_reference(b: Batch, window: int | None) -> torch.Tensor:
    """Gemma 2's eager attention per request, with its additive causal (sliding) mask."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = SimpleNamespace(num_key_value_groups=HEADS // KV_HEADS, training=False, head_dim=HD)
    outs, start = [], 0
    for r, (c, n) in enumerate(PLAN):
        k, v = full_sequence(b, r, window)
        qpos, kpos = torch.arange(c, c + n).unsqueeze(1), torch.arange(c + n)
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window is not None else True)
        mask = torch.zeros(n, c + n).masked_fill(~visible, float("-inf"))[None, None]
        q, k, v = (x.float().transpose(0, 1)[None] for x in (b.q[start : start + n], k, v))
        out, _ = eager_attention_forward(module, q, k, v, mask, scaling=SCALE, softcap=CAP)
        outs.append(out[0])
        start += n
    return torch.cat(outs)


def torch_path(b: Batch, window: int | None, softcap: float | None) -> torch.Tensor:
    counts, computed = torch.tensor([n for _, n in PLAN]), torch.tensor([c for c, _ in PLAN])
    rows = torch.arange(len(PLAN))
    reqs = StepRequests(rows, computed, counts, torch.cumsum(counts, 0) - counts,
                        torch.cat([torch.arange(c, c + n) for c, n in PLAN]), torch.repeat_interleave(rows, counts))
    meta = build_metadata(b.table, BS, window, reqs, kv_bytes_per_token=2 * KV_HEADS * HD * 4)
    cache = b.cache.nan_to_num(0.0)  # it reads whole blocks, unwritten slots included
    return paged_attention(b.q, b.k, b.v, cache, meta, GatherBuffer(1024, KV_HEADS, HD, b.q.dtype, "cpu"), SCALE,
                           softcap)


def triton_path(b: Batch, softcap: float) -> torch.Tensor:
    pytest.importorskip("triton", reason="triton is an optional extra: pip install 'kvengine[cuda]'")
    from worker.ops.triton_attention import TritonAttentionMetadata, triton_paged_attention

    counts = b.meta.query_start_loc[1:] - b.meta.query_start_loc[:-1]
    meta = TritonAttentionMetadata(**vars(b.meta), max_query_len=int(counts.max()))
    return triton_paged_attention(b.q, b.k, b.v, b.cache, meta, SCALE, softcap)


PATHS = {
    "cpu": lambda b, window: cpu_paged_attention(b.q, b.k, b.v, b.cache, b.meta, SCALE, CAP),
    "torch": lambda b, window: torch_path(b, window, CAP),
    "triton": lambda b, window: triton_path(b, CAP),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("window", [None, 24])
def test_softcapped_attention_matches_transformers_gemma2(path, window):
    b = make_batch(PLAN, HEADS, KV_HEADS, HD, BS, window)
    expected = transformers_reference(b, window)
    got = PATHS[path](b, window).view(expected.shape)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    uncapped = torch_path(make_batch(PLAN, HEADS, KV_HEADS, HD, BS, window), window, None).view(expected.shape)
    assert (uncapped - expected).abs().max() > 1e-2  # the cap changes the result: the test would see it missing


@pytest.mark.parametrize("window", [None, 24])
def test_softcapped_cpu_kernel_in_bfloat16(window):
    """bf16 K/V (scores by bf16 dot products where the CPU has them): within a bf16 step of fp32 attention."""
    b = make_batch(PLAN, HEADS, KV_HEADS, HD, BS, window, torch.bfloat16)
    expected = transformers_reference(b, window)
    got = PATHS["cpu"](b, window).view(expected.shape)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=2**-7)
