"""Paged attention per layer call: the in-place CPU kernel (worker/ops) vs the torch path (worker/attention.py),
and over a quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2) against the model's dtype.

    python -m bench.attention_bench                  # built-in model shapes, 2 threads
    python -m bench.attention_bench --threads 1 --repeats 50
    python -m bench.attention_bench --only-kv-dtypes # just the quantized-cache table: decode 64 x context 4,096
    python -m bench.attention_bench --shared-prefix 384 --heads 15 --kv-heads 5 --head-size 64  # just the prefix table

Each case is one step of one layer: metadata is built once per step (its time is printed apart) and each
layer call writes the step's K/V and attends. Figures are medians of repeats; they depend on the machine and
on what else runs there, and are printed, never asserted.
"""

import argparse
import random
import statistics

import torch

from bench.timing import interleaved, medians, repeat, stopwatch
from worker.attention import DECODE_CHUNK_BYTES, GatherBuffer, StepRequests, build_metadata, paged_attention
from worker.kv_quant import KVCache, QuantizedKV, allocate, write_quantized
from worker.ops.cpu_attention import build_cpu_metadata, cpu_paged_attention, load_extension, paged_attention_cpu

HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 4, 32, 16  # the built-in model
PREFIX_BATCH, PREFIX_CONTEXT, PREFIX_LAYERS = 16, 576, 32  # the shared-prefix table's decode step


def table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=False)]
    print(f"\n{title}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths, strict=True)))


def decode_plan(rng: random.Random) -> list[tuple[int, int]]:
    """64 decode tokens, contexts spread evenly over 300..872 (mean 586), in random order."""
    plan = [(300 + 572 * i // 63, 1) for i in range(64)]
    rng.shuffle(plan)
    return plan


def mixed_plan(rng: random.Random) -> list[tuple[int, int]]:
    """2,048 tokens: 56 decodes (contexts ~586), a fresh prefill chunk and two chunks over cached prefixes."""
    return [*decode_plan(rng)[:56], (0, 704), (512, 640), (1024, 648)]


class Step:
    """One step's inputs for one layer: a cache holding every request's prefix, and the new q/k/v."""

    def __init__(self, plan, dtype, scattered: bool, seed=0, kv_quant: str = "", shape=(HEADS, KV_HEADS, HEAD_SIZE)):
        heads, kv_heads, head_size = shape
        self.head_size = head_size
        g = torch.Generator().manual_seed(seed)
        need = [-(-(c + n) // BLOCK_SIZE) for c, n in plan]
        num_blocks = sum(need) + 1
        ids = torch.randperm(num_blocks - 1, generator=g) + 1 if scattered else torch.arange(1, num_blocks)
        self.table = torch.zeros(len(plan), max(need), dtype=torch.int32)
        used = 0
        for r, n in enumerate(need):
            self.table[r, :n] = ids[used : used + n].to(torch.int32)
            used += n
        self.cache: KVCache = torch.randn(2, kv_heads, num_blocks, BLOCK_SIZE, head_size, generator=g).to(dtype)
        if kv_quant:
            self.cache = quantized(self.cache, kv_quant)
        tokens = sum(n for _, n in plan)
        self.q = torch.randn(tokens, heads, head_size, generator=g).to(dtype)
        self.k = torch.randn(tokens, kv_heads, head_size, generator=g).to(dtype)
        self.v = torch.randn(tokens, kv_heads, head_size, generator=g).to(dtype)
        counts, computed = torch.tensor([n for _, n in plan]), torch.tensor([c for c, _ in plan])
        rows = torch.arange(len(plan))
        self.reqs = StepRequests(
            rows=rows,
            num_computed=computed,
            num_scheduled=counts,
            query_start=torch.cumsum(counts, 0) - counts,
            positions=torch.cat([torch.arange(c, c + n) for c, n in plan]),
            token_rows=torch.repeat_interleave(rows, counts),
        )
        self.kv_bytes_per_token = 2 * kv_heads * head_size * self.q.element_size()
        max_tokens = self.table.shape[1] * BLOCK_SIZE
        self.buffer = GatherBuffer(
            max(max_tokens, DECODE_CHUNK_BYTES // self.kv_bytes_per_token), kv_heads, head_size, dtype, "cpu"
        )

    def torch_meta(self):
        return build_metadata(self.table, BLOCK_SIZE, None, self.reqs, self.kv_bytes_per_token)

    def kernel_meta(self):
        r = self.reqs
        return build_cpu_metadata(self.table, r.rows, r.num_computed, r.num_scheduled, BLOCK_SIZE, None)

    def torch_layer(self, meta):
        return paged_attention(self.q, self.k, self.v, self.cache, meta, self.buffer, self.head_size**-0.5)

    def kernel_layer(self, meta):
        return cpu_paged_attention(self.q, self.k, self.v, self.cache, meta, self.head_size**-0.5)


def quantized(cache: torch.Tensor, kv_quant: str) -> QuantizedKV:
    """The cache's values written into a quantized cache of its shape, a block at a time as the worker would."""
    heads, hd = cache.shape[1], cache.shape[4]
    q = allocate(tuple(cache.shape), kv_quant, lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    slots = torch.arange(cache.shape[2] * cache.shape[3])
    flat = cache.view(2, heads, -1, hd)
    write_quantized(q, flat[0].transpose(0, 1), flat[1].transpose(0, 1), slots)
    return q


def median_ms(fn, repeats: int) -> float:
    return statistics.median(repeat(fn, repeats)) * 1e3


def bench_case(name: str, plan, dtype, scattered: bool, repeats: int) -> list:
    step = Step(plan, dtype, scattered)
    with torch.inference_mode():
        tm, km = step.torch_meta(), step.kernel_meta()
        diff = (step.torch_layer(tm).float() - step.kernel_layer(km).float()).abs().max().item()
        t_meta, k_meta = median_ms(step.torch_meta, repeats), median_ms(step.kernel_meta, repeats)
        t_layer = median_ms(lambda: step.torch_layer(tm), repeats)
        k_layer = median_ms(lambda: step.kernel_layer(km), repeats)
    return [
        name,
        "scattered" if scattered else "consecutive",
        str(dtype).removeprefix("torch."),
        f"{t_meta:.3f}",
        f"{t_layer:.3f}",
        f"{k_meta:.3f}",
        f"{k_layer:.3f}",
        f"{t_layer / k_layer:.1f}x",
        f"{diff:.1e}",
    ]


KV_DTYPES = ("", "int8", "fp8_e4m3", "fp8_e5m2")  # "": the model's dtype


def kv_dtype_rows(dtype, context: int, repeats: int, shape: tuple[int, int, int]) -> list[list]:
    """Decode 64 at one context, scattered blocks: the kernel's layer call per KV cache dtype, against the first. The
    dtypes take turns within each round (interleaved), so a neighbour's load falls on all of them alike."""
    plan = [(context - 1, 1)] * 64
    steps = {kv_quant: Step(plan, dtype, scattered=True, kv_quant=kv_quant, shape=shape) for kv_quant in KV_DTYPES}
    with torch.inference_mode():
        metas = {kv_quant: step.kernel_meta() for kv_quant, step in steps.items()}
        outs = {kv_quant: step.kernel_layer(metas[kv_quant]).float() for kv_quant, step in steps.items()}

        def timed(kv_quant: str) -> float:
            with stopwatch() as lap:
                steps[kv_quant].kernel_layer(metas[kv_quant])
            return lap.wall * 1e3

        ms = medians(interleaved({kv_quant: lambda _, kv_quant=kv_quant: timed(kv_quant) for kv_quant in KV_DTYPES},
                                 repeats))
    rows = []
    for kv_quant in KV_DTYPES:
        kv_bytes = 64 * context * shape[1] * 2 * shape[2] * (1 if kv_quant else steps[""].q.element_size())
        diff = (outs[kv_quant] - outs[""]).abs().max().item()
        rows.append([kv_quant or str(dtype).removeprefix("torch."), f"{kv_bytes / 2**20:.0f} MiB",
                     f"{ms[kv_quant]:.2f}", f"{ms[''] / ms[kv_quant]:.2f}x", f"{diff:.1e}"])
    return rows


def kv_dtype_table(args) -> None:
    shape = (args.heads, args.kv_heads, args.head_size)
    for dtype in (torch.bfloat16, torch.float32):
        table(f"decode 64 x context {args.context:,} (scattered blocks), {args.heads}/{args.kv_heads} heads x "
              f"{args.head_size}, model {str(dtype).removeprefix('torch.')}, CPU kernel layer call (write K/V + attend), "
              f"{args.threads} threads, median of {args.repeats} interleaved rounds (ms)",
              ["KV cache", "K/V read", "layer", "speed-up", "max diff"],
              kv_dtype_rows(dtype, args.context, args.repeats, shape))


def shared_prefix_table(args) -> None:
    """One bf16 decode step over 32 layers' caches (together larger than the L3), 16 requests of 576 keys: blocks
    all distinct, against the first --shared-prefix keys' blocks shared by every request (as after prefix-cache
    hits, where vLLM's CPU decode gains). The two take turns within each round."""
    heads, kv_heads, hd = args.heads, args.kv_heads, args.head_size
    batch, context, layers = PREFIX_BATCH, PREFIX_CONTEXT, PREFIX_LAYERS
    nb, shared_nb = context // BLOCK_SIZE, args.shared_prefix // BLOCK_SIZE
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, kv_heads, batch * nb + 1, BLOCK_SIZE, hd, generator=g).bfloat16() for _ in range(layers)]
    q = torch.randn(batch, heads, hd, generator=g).bfloat16()
    query_start, seq_lens = torch.arange(batch + 1, dtype=torch.int32), torch.full((batch,), context, dtype=torch.int32)
    distinct = torch.arange(1, batch * nb + 1, dtype=torch.int32).view(batch, nb)
    shared = distinct.clone()
    shared[:, :shared_nb] = distinct[0, :shared_nb]

    def step(block_table: torch.Tensor) -> float:
        with stopwatch() as lap:
            for cache in caches:
                paged_attention_cpu(q, cache, block_table, query_start, seq_lens, -1, hd**-0.5)
        return lap.wall * 1e3

    ms = medians(interleaved({"distinct": lambda _: step(distinct), "shared prefix": lambda _: step(shared)},
                             args.repeats))
    kv = {"distinct": batch * nb, "shared prefix": shared_nb + batch * (nb - shared_nb)}
    rows = [[name, f"{kv[name] * BLOCK_SIZE * 2 * kv_heads * hd * 2 * layers / 2**20:.0f} MiB", f"{ms[name]:.1f}",
             f"{ms['distinct'] / ms[name]:.2f}x"] for name in ms]
    table(f"decode step, {batch} x {context} keys, {layers} layers, {heads}/{kv_heads} heads x {hd}, bf16, kernel "
          f"attend only, {args.threads} threads, median of {args.repeats} interleaved rounds (ms)",
          ["blocks", "K/V read", "step", "speed-up"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--context", type=int, default=4096, help="the KV dtype table's context per request")
    ap.add_argument("--only-kv-dtypes", action="store_true", help="only the KV dtype table")
    ap.add_argument("--heads", type=int, default=HEADS, help="the KV dtype table's q heads")
    ap.add_argument("--kv-heads", type=int, default=KV_HEADS, help="the KV dtype table's KV heads")
    ap.add_argument("--head-size", type=int, default=HEAD_SIZE, help="the KV dtype table's head size")
    ap.add_argument("--shared-prefix", type=int, default=0,
                    help="only the shared-prefix table (with --heads, --kv-heads, --head-size): keys shared by all")
    args = ap.parse_args()
    if args.shared_prefix and (args.shared_prefix % BLOCK_SIZE or args.shared_prefix >= PREFIX_CONTEXT):
        ap.error(f"--shared-prefix must be a multiple of the block size {BLOCK_SIZE} below the context {PREFIX_CONTEXT}")
    torch.set_num_threads(args.threads)
    with stopwatch() as lap:
        load_extension()
    print(f"extension ready in {lap.wall:.1f} s (compiles on first use on a machine)")
    if args.shared_prefix:
        shared_prefix_table(args)
        return
    kv_dtype_table(args)
    if args.only_kv_dtypes:
        return
    rng = random.Random(0)
    decode, mixed = decode_plan(rng), mixed_plan(rng)
    mean_ctx = statistics.mean(c for c, _ in decode)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for scattered in (True, False):
            rows.append(bench_case(f"decode 64, ctx ~{mean_ctx:.0f}", decode, dtype, scattered, args.repeats))
            rows.append(bench_case("mixed 2,048 tokens", mixed, dtype, scattered, args.repeats))
    table(
        f"paged attention, {HEADS}/{KV_HEADS} heads x {HEAD_SIZE}, block {BLOCK_SIZE}, {args.threads} threads, "
        f"median of {args.repeats} (ms; meta once per step, layer = write K/V + attend)",
        ["step", "blocks", "dtype", "torch meta", "torch layer", "kernel meta", "kernel layer", "speed-up", "max diff"],
        rows,
    )


if __name__ == "__main__":
    main()
