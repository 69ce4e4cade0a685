"""Model benchmarks: engine vs transformers generate, cached-prefix prefill, paged attention vs SDPA, the
worker's decode step, and native models against the transformers fallback (--model-impl).

    python -m bench.model_bench                 # everything, both models
    python -m bench.model_bench --only attention --device cuda
    python -m bench.model_bench --only step --models large --threads 2
    python -m bench.model_bench --only impl     # Qwen3- and MoE-shaped: native vs transformers fallback

Figures depend on the machine and on what else runs there; the numbers are printed, never asserted.
"""

import argparse
import gc
import itertools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.timing import CallTimes, repeat, stopwatch
from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from worker.attention import DECODE_CHUNK_BYTES, GatherBuffer, StepRequests, build_metadata, paged_attention
from worker.inproc_executor import InProcExecutor
from worker.model.tiny import write_model

BATCHES = itertools.count()  # request ids stay unique across batches of one engine
MODELS = {
    "tiny": {},  # the built-in default sizes
    "large": {
        "hidden_size": 1024,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 2816,
        "vocab_size": 8192,
    },
}


def table(title: str, header: list[str], rows: list[list]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    print(f"\n{title}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(r, widths, strict=True)))


def progress(msg: str) -> None:
    print(f"  ... {msg}", file=sys.stderr, flush=True)


# ---- engine vs transformers ---------------------------------------------------------------------


def make_engine(folder, device, max_model_len=1536, max_num_seqs=64, kv_bytes=2 << 30) -> EngineCore:
    config = engine_config(model=str(folder), device=device, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                           kv_cache_memory_bytes=[kv_bytes])
    return EngineCore(config, InProcExecutor(config))


def engine_generate(engine: EngineCore, prompts, out_lens) -> tuple[float, int]:
    """Seconds and output tokens for the whole workload, continuous batching."""
    tokens, tag = 0, next(BATCHES)
    with stopwatch() as lap:
        for i, (p, n) in enumerate(zip(prompts, out_lens, strict=True)):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            engine.add_request(EngineCoreRequest(f"b{tag}-{i}", p, params, arrival_time=time.time()))
        while engine.has_work():
            tokens += sum(len(o.new_token_ids) for o in engine.step().outputs)
    return lap.wall, tokens


def hf_generate(model, prompts, out_lens, batch_size: int, device) -> tuple[float, int]:
    """transformers generate in static batches of arriving requests (left padded, each batch runs to its
    longest output); counts only the tokens each request asked for."""
    useful = 0
    with stopwatch() as lap:
        for b in range(0, len(prompts), batch_size):
            useful += hf_batch(model, prompts, out_lens, range(b, min(b + batch_size, len(prompts))), device)
    return lap.wall, useful


def hf_batch(model, prompts, out_lens, idx: range, device) -> int:
    """One static batch through generate; the tokens its requests asked for."""
    width = max(len(prompts[i]) for i in idx)
    ids = torch.zeros(len(idx), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, i in enumerate(idx):
        ids[row, width - len(prompts[i]) :] = torch.tensor(prompts[i])
        mask[row, width - len(prompts[i]) :] = 1
    n = max(out_lens[i] for i in idx)
    model.generate(
        ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return sum(out_lens[i] for i in idx)


def workloads(vocab: int, quick: bool):
    rng = random.Random(0)
    uniform_n, ragged_n = (8, 16) if quick else (32, 64)
    uniform = ([[rng.randrange(3, vocab) for _ in range(128)] for _ in range(uniform_n)], [64] * uniform_n)
    ragged_prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(32, 1024))] for _ in range(ragged_n)]
    ragged = (ragged_prompts, [rng.randint(16, 256) for _ in range(ragged_n)])
    return {f"uniform {uniform_n} x 128 -> 64": uniform, f"ragged {ragged_n} x 32-1024 -> 16-256": ragged}


def bench_throughput(name: str, folder, device, quick: bool, hf_batch: int) -> list[list]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    engine = make_engine(folder, device)
    rows = []
    for wl_name, (prompts, outs) in workloads(hf.config.vocab_size, quick).items():
        progress(f"{name}: {wl_name}: engine")
        with torch.inference_mode():
            e_s, e_tok = engine_generate(engine, prompts, outs)
            progress(f"{name}: {wl_name}: transformers generate")
            h_s, h_tok = hf_generate(hf, prompts, outs, hf_batch, device)
        rows.append(
            [name, wl_name, f"{e_tok / e_s:.1f}", f"{h_tok / h_s:.1f}", f"{(e_tok / e_s) / (h_tok / h_s):.2f}x"]
        )
    engine.shutdown()
    del hf, engine
    gc.collect()
    return rows


# ---- cached vs uncached prefix -------------------------------------------------------------------


def bench_prefix(name: str, folder, device, repeats: int = 3) -> list[list]:
    engine = make_engine(folder, device)
    rng = random.Random(1)
    vocab = engine.scheduler.vocab_size if hasattr(engine.scheduler, "vocab_size") else 1000
    vocab = min(vocab, 1000)

    def first_token_time(prompt) -> float:
        return engine_generate(engine, [prompt], [1])[0]

    cold, warm = [], []
    for _ in range(repeats):
        prefix = [rng.randrange(3, vocab) for _ in range(1024)]
        cold.append(first_token_time(prefix + [rng.randrange(3, vocab) for _ in range(16)]))
        warm.append(first_token_time(prefix + [rng.randrange(3, vocab) for _ in range(16)]))
    engine.shutdown()
    c, w = min(cold), min(warm)
    return [[name, f"{c * 1e3:.1f}", f"{w * 1e3:.1f}", f"{c / w:.1f}x"]]


# ---- one decode step of the worker -----------------------------------------------------------------


def timed_worker_run(folder, device, batch: int, prompt_len: int, steps: int, model_impl: str = "auto"):
    """A worker running `batch` prompts of prompt_len (one prefill step) and `steps` decode steps; (worker, the
    CallTimes of its execute_model calls: the prefill, the decode steps, the last empty step)."""
    from tests.worker.harness import Driver, kv_config
    from worker.worker import Worker

    config = engine_config(model=str(folder), device=device, max_model_len=prompt_len + steps + 16,
                           max_num_seqs=batch, max_num_batched_tokens=batch * prompt_len,
                           kv_cache_memory_bytes=[1 << 30], model_impl=model_impl)
    w = Worker(config)
    cfg = kv_config(w, batch * -(-(prompt_len + steps + 16) // 16) + 1)
    w.init_kv_cache(cfg)
    w.execute_model = timed = CallTimes(w.execute_model, cpu=True, sync=torch.cuda.synchronize if device == "cuda" else None)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 1000) for _ in range(prompt_len)] for _ in range(batch)]
    Driver(w, cfg, prefix_caching=False).run(prompts, steps + 1)
    return w, timed


def bench_step(name: str, folder, device, batch: int = 64, prompt_len: int = 256, steps: int = 32) -> list[list]:
    """Worker.execute_model of decode steps at `batch` requests (prompts of prompt_len, prefilled first): the
    median step, including the runner's inputs, metadata, forward and sampling, not the scheduler. Wall time, and
    the thread's CPU time (with --threads 1 all of the step's work, and less moved by other processes)."""
    w, timed = timed_worker_run(folder, device, batch, prompt_len, steps)
    decode = sorted(timed.wall[1:-1])  # not the prefill, not the last (empty) step
    progress(f"{name}: decode steps (ms): {' '.join(f'{t * 1e3:.1f}' for t in timed.wall[1:-1])}")
    return [[name, batch, str(w.dtype).removeprefix("torch."), w.runner.attention_backend,
             f"{decode[len(decode) // 2] * 1e3:.2f}", f"{decode[0] * 1e3:.2f}",
             f"{statistics.median(timed.cpu[1:-1]) * 1e3:.2f}"]]


# ---- native implementation vs the transformers fallback ------------------------------------------

IMPL_MODELS = {  # transformers config class and sizes: Qwen3-0.6B's layer shapes, and a small Qwen3-MoE
    "qwen3-shaped": ("Qwen3Config", {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
                                     "num_key_value_heads": 8, "head_dim": 128}),
    "moe-shaped": ("Qwen3MoeConfig", {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
                                      "num_key_value_heads": 4, "head_dim": 64, "num_experts": 32,
                                      "num_experts_per_tok": 4, "moe_intermediate_size": 384}),
}


def write_impl_model(name: str, folder: Path) -> Path:
    import transformers

    cls_name, sizes = IMPL_MODELS[name]
    config = getattr(transformers, cls_name)(vocab_size=8192, num_hidden_layers=8, max_position_embeddings=4096,
                                             eos_token_id=None, **sizes)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def bench_impl(name: str, folder, device, impl: str) -> list:
    """Median decode step at batch 1 and 64 (prompts of 128, 16 steps) and the prefill of one 2,048-token prompt
    (best of 3), in ms."""
    row = [name, impl]
    for batch in (1, 64):
        w, timed = timed_worker_run(folder, device, batch, 128, 16, impl)
        row.append(f"{statistics.median(timed.wall[1:-1]) * 1e3:.1f}")
    prefills = [timed_worker_run(folder, device, 1, 2048, 1, impl)[1].wall[0] for _ in range(3)]
    return [*row, f"{min(prefills) * 1e3:.0f}", str(w.dtype).removeprefix("torch."), w.runner.attention_backend]


def run_impl(device) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench_impl(name, write_impl_model(name, Path(tmp) / name), device, impl)
                for name in IMPL_MODELS for impl in ("native", "transformers")]
    table("native implementation vs the transformers fallback (ms)",
          ["model", "impl", "decode b=1", "decode b=64", "prefill 2,048", "dtype", "attention"], rows)


# ---- paged attention vs SDPA on contiguous K/V ---------------------------------------------------


def bench_attention(
    device, heads=16, kv_heads=4, head_dim=64, scattered=True, seqs=64, ctx=1024, block_size=16, iters=10
):
    """One decode step of one layer: 64 sequences with 1,024 tokens each vs SDPA on the same K/V stored
    contiguously per sequence. Blocks scattered at random, or consecutive ids (a fresh pool)."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    nblk = seqs * ctx // block_size
    cache = torch.randn(2, kv_heads, nblk + 1, block_size, head_dim, generator=g).to(device, dtype)
    ids = torch.randperm(nblk, generator=g) if scattered else torch.arange(nblk)
    table = (ids + 1).view(seqs, -1).to(torch.int32).to(device)
    q = torch.randn(seqs, heads, head_dim, generator=g).to(device, dtype)
    k_new = torch.randn(seqs, kv_heads, head_dim, generator=g).to(device, dtype)
    v_new = torch.randn_like(k_new)
    pos = torch.full((seqs,), ctx - 1, device=device)
    rows = torch.arange(seqs, device=device)
    kvbpt = 2 * kv_heads * head_dim * cache.element_size()
    meta = build_metadata(
        table, block_size, None, StepRequests(rows, pos, torch.ones_like(pos), rows, pos, rows), kvbpt
    )
    buffer = GatherBuffer(max(ctx, DECODE_CHUNK_BYTES // kvbpt), kv_heads, head_dim, dtype, device)
    scale = head_dim**-0.5

    def paged():
        return paged_attention(q, k_new, v_new, cache, meta, buffer, scale)

    with torch.inference_mode():
        paged()  # writes the new tokens, so the dense copy below holds the same K/V
        dense_kv = [
            cache[i][:, table.long()].permute(1, 0, 2, 3, 4).reshape(seqs, kv_heads, ctx, head_dim).contiguous()
            for i in (0, 1)
        ]

    def dense():
        return F.scaled_dot_product_attention(q.unsqueeze(2), *dense_kv, scale=scale, enable_gqa=True)

    def timed(fn) -> float:
        return min(repeat(fn, iters, sync=torch.cuda.synchronize if device == "cuda" else None))

    with torch.inference_mode():
        diff = (paged().view(seqs, heads, head_dim) - dense().squeeze(2)).abs().max().item()
        p, d = timed(paged), timed(dense)
    shape = f"{seqs} x {ctx}, {heads}/{kv_heads} heads x {head_dim}"
    return [
        [
            shape,
            "scattered" if scattered else "consecutive",
            torch.get_num_threads(),
            f"{p * 1e3:.2f}",
            f"{d * 1e3:.2f}",
            f"{p / d:.2f}x",
            f"{diff:.1e}",
        ]
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="tiny,large")
    ap.add_argument("--only", choices=["throughput", "prefix", "attention", "step", "impl"], action="append")
    ap.add_argument("--quick", action="store_true", help="smaller workloads (16 ragged requests)")
    ap.add_argument("--hf-batch", type=int, default=8, help="transformers generate batch size")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = args.only or ["attention", "prefix", "step", "throughput"]
    if "attention" in parts:
        rows = [
            row
            for shape in ({}, {"heads": 8, "kv_heads": 4, "head_dim": 32})
            for scattered in (True, False)
            for row in bench_attention(args.device, scattered=scattered, **shape)
        ]
        table(
            "paged attention vs SDPA on contiguous K/V (one layer, one decode step, best of 10)",
            ["shape", "blocks", "threads", "paged ms", "SDPA ms", "ratio", "max |diff|"],
            rows,
        )
    if "impl" in parts:
        run_impl(args.device)
    if parts == ["impl"]:
        return
    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        for name in args.models.split(","):
            progress(f"writing the {name} model")
            folders[name] = write_model(
                Path(tmp) / name, eos_token_id=None, max_position_embeddings=2048, **MODELS[name]
            )
        if "prefix" in parts:
            rows = [r for name, f in folders.items() for r in bench_prefix(name, f, args.device)]
            table(
                "prefill of 1,024 + 16 tokens: prefix not cached vs cached (best of 3)",
                ["model", "uncached ms", "cached ms", "speed-up"],
                rows,
            )
        if "step" in parts:
            rows = [r for name, f in folders.items() for r in bench_step(name, f, args.device)]
            table(
                "worker decode step (execute_model), 64 requests of 256 + 1..32 tokens",
                ["model", "batch", "dtype", "attention", "median ms", "best ms", "median CPU ms"],
                rows,
            )
        if "throughput" in parts:
            rows = [
                r
                for name, f in folders.items()
                for r in bench_throughput(name, f, args.device, args.quick, args.hf_batch)
            ]
            table(
                "output tokens/s: engine (continuous batching) vs transformers generate",
                ["model", "workload", "engine tok/s", "HF tok/s", "engine/HF"],
                rows,
            )


if __name__ == "__main__":
    main()
