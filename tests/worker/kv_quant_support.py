"""Attention batches over a quantized KV cache, written by any of the three writers, with their dense references
(no tests here)."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tests.worker.attention_support import Batch, dense, make_batch, skipped_blocks
from worker.attention import StepRequests
from worker.kv_quant import QuantizedKV, allocate, dequantize, write_quantized
from worker.ops.cpu_attention import build_cpu_metadata

QUANTS = ["int8", "fp8_e4m3", "fp8_e5m2"]
# Kernel outputs against dense attention over the ORIGINAL values, unit-normal K/V/q: the error a format's rounding
# brings (int8: half a step of absmax / 127, ~0.4% of a block's largest value; e4m3: 2^-4 relative; e5m2: 2^-3),
# measured at 0.021 / 0.104 / 0.181 on MIXED; the bounds leave about 2x.
QUANT_ERROR_BOUND = {"int8": 0.05, "fp8_e4m3": 0.25, "fp8_e5m2": 0.4}

Writer = Callable[[torch.Tensor, torch.Tensor, QuantizedKV, object, torch.Tensor], None]


@dataclass
class QuantBatch:
    b: Batch  # its cache is the unquantized one make_batch filled; b.expected: dense over the original values
    cache: QuantizedKV  # the prefixes, written a chunk at a time by the writer under test
    expected: torch.Tensor  # fp64 dense attention over the dequantized values, the step's K/V as the reference writes them
    plan: list[tuple[int, int]]


def reference_writer(k, v, cache, meta, slots) -> None:
    write_quantized(cache, k, v, slots)


def garbage_cache(shape: tuple[int, ...], quant: str, seed: int = 1) -> QuantizedKV:
    """Random codes and NaN scales everywhere: a block a kernel reads without writing it first gives NaN."""
    cache = allocate(shape, quant, lambda s, dtype: torch.zeros(s, dtype=dtype))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)
    cache.data.view(torch.uint8).copy_(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8))
    cache.scales.fill_(float("nan"))
    return cache


def slot_of(table: torch.Tensor, r: int, p: int, bs: int) -> int:
    return int(table[r, p // bs]) * bs + p % bs


def write_prefixes(b: Batch, plan, cache: QuantizedKV, writer: Writer, chunk: int, window) -> None:
    """Every request's cached prefix (the values make_batch put in b.cache) written chunk tokens a step."""
    bs, heads, hd = b.cache.shape[3], b.cache.shape[1], b.cache.shape[4]
    flat = b.cache.view(2, heads, -1, hd)
    first = [skipped_blocks(c, window, bs) * bs for c, _ in plan]  # the window's null blocks are never written
    for i in range(0, max(c for c, _ in plan), chunk):
        rows, computed, counts, slots = [], [], [], []
        for r, (c, _) in enumerate(plan):
            p0 = first[r] + i
            if p0 < c:
                n = min(chunk, c - p0)
                rows.append(r)
                computed.append(p0)
                counts.append(n)
                slots += [slot_of(b.table, r, p, bs) for p in range(p0, p0 + n)]
        if not rows:
            continue
        idx = torch.tensor(slots)
        k, v = flat[0, :, idx].transpose(0, 1).contiguous(), flat[1, :, idx].transpose(0, 1).contiguous()
        meta = build_cpu_metadata(b.table, torch.tensor(rows), torch.tensor(computed), torch.tensor(counts), bs, None)
        writer(k, v, cache, meta, idx)


def step_slots(b: Batch, plan) -> torch.Tensor:
    bs = b.cache.shape[3]
    return torch.tensor([slot_of(b.table, r, p, bs) for r, (c, n) in enumerate(plan) for p in range(c, c + n)])


def quant_batch(plan, heads, kv_heads, hd, bs, quant, window=None, dtype=torch.float32, writer=reference_writer,
                chunk=5, placement="scattered", seed=0) -> QuantBatch:
    b = make_batch(plan, heads, kv_heads, hd, bs, window, dtype, placement, seed)
    cache = garbage_cache(tuple(b.cache.shape), quant)
    write_prefixes(b, plan, cache, writer, chunk, window)
    after = QuantizedKV(cache.data.clone(), cache.scales.clone())
    write_quantized(after, b.k, b.v, step_slots(b, plan))
    return QuantBatch(b, cache, dense_over(b, plan, after, window), plan)


def dense_over(b: Batch, plan, cache: QuantizedKV, window) -> torch.Tensor:
    """Dense fp64 attention of each request's step queries over the values cache holds for its sequence (fp32, as the
    CPU kernel reads them); positions left of a window's null blocks count as 0."""
    bs, heads, hd = b.cache.shape[3], b.cache.shape[1], b.cache.shape[4]
    codes = cache.data.view(2, heads, -1, hd)
    scales = cache.scales.repeat_interleave(bs, dim=2)
    out, t = [], 0
    for r, (c, n) in enumerate(plan):
        first = skipped_blocks(c, window, bs) * bs
        kv = torch.zeros(2, c + n, heads, hd, dtype=torch.float64)
        for p in range(first, c + n):
            s = slot_of(b.table, r, p, bs)
            kv[:, p] = dequantize(codes[:, :, s], scales[:, :, s, None]).double()
        q = torch.cat([torch.zeros(c, *b.q.shape[1:], dtype=b.q.dtype), b.q[t : t + n]])
        out.append(dense(q, kv[0], kv[1], window)[c:])
        t += n
    return torch.cat(out)


def step_requests(plan) -> StepRequests:
    counts, computed = torch.tensor([n for _, n in plan]), torch.tensor([c for c, _ in plan])
    rows = torch.arange(len(plan))
    return StepRequests(rows=rows, num_computed=computed, num_scheduled=counts, query_start=torch.cumsum(counts, 0) - counts,
                        positions=torch.cat([torch.arange(c, c + n) for c, n in plan]),
                        token_rows=torch.repeat_interleave(rows, counts))
