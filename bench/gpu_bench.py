"""Output tokens/s on one GPU: the engine with CUDA graphs, the engine with --enforce-eager, and transformers'
generate, on the same model (e.g. ~1B parameters written by `kvengine make-model`) and the same prompts.

    kvengine make-model /tmp/m1b --hidden-size 2048 --num-layers 24 --num-heads 16 --num-kv-heads 8 \\
        --intermediate-size 4096 --vocab-size 32000
    python -m bench.gpu_bench --model /tmp/m1b --concurrency 64,256

Each concurrency c is c requests of --input-len random tokens sent at once, each generating --output-len tokens
(EOS ignored, greedy); the engine runs in-process (no IPC) with max_num_seqs = the largest c, HF generate runs
the c prompts as one batch. Figures are printed, never asserted; on the CPU there are no graphs (the row says so).
"""

import argparse
import gc
import math
import random
import sys
import time
from pathlib import Path

import torch

from bench.timing import stopwatch
from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from worker.inproc_executor import InProcExecutor


def progress(msg: str) -> None:
    print(f"  ... {msg}", file=sys.stderr, flush=True)


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def count_parameters(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle is not a dict)
                total += math.prod(f.get_slice(key).get_shape())
    return total


def device_sync(device: str):
    """What waits for the device's queued work (None on the CPU)."""
    return torch.cuda.synchronize if device == "cuda" else None


def run_engine(engine: EngineCore, prompts: list[list[int]], output_len: int, tag: str, sync=None) -> float:
    """Output tokens/s of all prompts sent at once, until the last finishes."""
    tokens = 0
    with stopwatch(sync) as lap:
        for i, p in enumerate(prompts):
            params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
            engine.add_request(EngineCoreRequest(f"{tag}-{i}", p, params, arrival_time=time.time()))
        while engine.has_work():
            tokens += sum(len(o.new_token_ids) for o in engine.step().outputs)
    return tokens / lap.wall


def bench_engine(args, enforce_eager: bool, prompts_by_c: dict[int, list[list[int]]]) -> dict[int, float]:
    c_max = max(prompts_by_c)
    config = engine_config(model=args.model, device=args.device, dtype=args.dtype, enforce_eager=enforce_eager,
                           max_model_len=args.input_len + args.output_len + 16, max_num_seqs=c_max,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           kv_cache_memory_bytes=[args.kv_cache_gib << 30])
    with stopwatch() as lap:
        engine = EngineCore(config, InProcExecutor(config))
    progress(f"engine ({'eager' if enforce_eager else 'graphs'}) ready in {lap.wall:.1f} s")
    results = {}
    with torch.inference_mode():
        run_engine(engine, prompts_by_c[min(prompts_by_c)][:8], args.output_len, "warmup")  # Triton compiles
        for c, prompts in prompts_by_c.items():
            results[c] = run_engine(engine, prompts, args.output_len, f"c{c}", device_sync(args.device))
            progress(f"engine ({'eager' if enforce_eager else 'graphs'}) at {c}: {results[c]:.0f} tok/s")
    engine.shutdown()
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return results


def bench_hf(args, prompts_by_c: dict[int, list[list[int]]]) -> dict[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    results = {}

    def generate(prompts, n):
        ids = torch.tensor(prompts, device=args.device)  # one length: no padding
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate(prompts_by_c[min(prompts_by_c)][:8], 8)  # warm-up
        for c, prompts in prompts_by_c.items():
            with stopwatch(device_sync(args.device)) as lap:
                generate(prompts, args.output_len)
            results[c] = c * args.output_len / lap.wall
            progress(f"HF generate at {c}: {results[c]:.0f} tok/s")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="HF folder, e.g. written by kvengine make-model")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="engine and HF; default: bfloat16 on CUDA, "
                    "float32 on the CPU")
    ap.add_argument("--concurrency", default="64,256", help="comma list of concurrent requests")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-gib", type=int, default=16, help="KV cache of the engine (no memory profile)")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: graphs, eager, hf")
    args = ap.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_bench: no CUDA device here (use --device cpu for a dry run)")
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    params = count_parameters(Path(args.model))
    sizes = [int(c) for c in args.concurrency.split(",")]
    prompts_by_c = {c: make_prompts(c, args.input_len, vocab, seed=c) for c in sizes}
    skip = set(filter(None, args.skip.split(",")))
    graphs_here = args.device == "cuda"
    cols: dict[str, dict[int, float]] = {}
    if "graphs" not in skip and graphs_here:
        cols["graphs"] = bench_engine(args, False, prompts_by_c)
    if "eager" not in skip:
        cols["eager"] = bench_engine(args, True, prompts_by_c)
    if "hf" not in skip:
        cols["hf"] = bench_hf(args, prompts_by_c)

    def fig(name: str, c: int) -> str:
        if name == "graphs" and not graphs_here:
            return "n/a (CPU)"
        return f"{cols[name][c]:.0f}" if name in cols else "-"

    def ratio(a: str, b: str, c: int) -> str:
        return f"{cols[a][c] / cols[b][c]:.2f}x" if a in cols and b in cols else "-"

    header = ["concurrent", "graphs tok/s", "eager tok/s", "HF generate tok/s", "graphs/eager", "graphs/HF"]
    rows = [[str(c), fig("graphs", c), fig("eager", c), fig("hf", c), ratio("graphs", "eager", c),
             ratio("graphs", "hf", c)] for c in sizes]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\noutput tokens/s, {params / 1e6:,.0f}M-parameter model, {args.input_len} -> {args.output_len} tokens "
          f"per request, {args.dtype} weights, {name}")
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=True)]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths, strict=True)))


if __name__ == "__main__":
    main()
