"""kvengine beside llama.cpp (its Python binding, llama-cpp-python) on the same GGUF file, interleaved.

    python -m bench.llamacpp_bench --llamacpp-venv ../scratch/llamacpp-venv --model FILE.gguf --rounds 3

Installs nothing: give it a venv holding llama-cpp-python (docs/benchmarks.md says how to build one). Each engine
runs in a fresh process per round (the order rotates): it loads the GGUF with --threads threads, warms up on other
prompts, then times
- batch 1: a --input-len-token prompt; TTFT (prompt in, first token out) and the decode time per token of the
  next --output-len tokens (greedy, EOS ignored);
- batch --batch-size: as many such prompts at once, --output-len tokens each; output tokens / wall time of the
  batch, and the decode-only rate (after the last prompt's first token).
llama.cpp runs the prompts of the batch as one sequence each (n_seq_max = batch) and decodes them in one
llama_decode per step through the binding's low-level API. kvengine serves the file with --cpu-threads-bind
0..threads-1. A run during which other processes used more than --max-foreign-load cores is discarded.

This module is also each engine's runner (`--run ENGINE`); it imports only the standard library and bench.timing
at the top, so the llama.cpp venv's python can run it.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.timing import clean_round, foreign_load, interleaved

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ["kvengine", "llamacpp"]


def run_llamacpp(model: str, prompts: dict, output_len: int, threads: int) -> dict[str, float]:
    import llama_cpp
    import numpy as np

    batch = len(prompts["batch"])
    ctx_len = batch * (len(prompts["one"]) + output_len + 16)
    llama_cpp.llama_backend_init()
    lm = llama_cpp.llama_model_load_from_file(model.encode(), llama_cpp.llama_model_default_params())
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = ctx_len, 512, 512, batch
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(lm, params)
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(lm))
    memory = llama_cpp.llama_get_memory(ctx)
    lb = llama_cpp.llama_batch_init(512, 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits); the greedy token of each logits row."""
        lb.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            lb.token[i], lb.pos[i], lb.n_seq_id[i], lb.logits[i] = tok, pos, 1, logits
            lb.seq_id[i][0] = seq
        if llama_cpp.llama_decode(ctx, lb) != 0:
            raise RuntimeError("llama_decode failed")
        rows = [i for i, item in enumerate(items) if item[3]]
        return [int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                for i in rows]

    def prefill(tokens: list[int], seq: int) -> int:
        out: list[int] = []
        for start in range(0, len(tokens), 512):
            chunk = tokens[start:start + 512]
            out = decode([(t, start + j, seq, start + j == len(tokens) - 1) for j, t in enumerate(chunk)])
        return out[-1]

    def run(batch_prompts: list[list[int]], steps: int) -> tuple[float, float]:
        """(seconds to the last prompt's first token, to the end); the prompts prefill one after the other."""
        llama_cpp.llama_memory_clear(memory, True)
        start = time.perf_counter()
        last = [prefill(p, s) for s, p in enumerate(batch_prompts)]
        first = time.perf_counter() - start
        for step in range(steps - 1):
            last = decode([(t, len(p) + step, s, True) for s, (t, p) in enumerate(zip(last, batch_prompts, strict=True))])
        return first, time.perf_counter() - start

    run(prompts["warmup"][:batch], 4)
    ttft, total = run([prompts["one"]], output_len)
    first8, total8 = run(prompts["batch"], output_len)
    return batch_times(ttft, total, first8, total8, output_len, batch)


def batch_times(ttft: float, total: float, first8: float, total8: float, output_len: int, batch: int) -> dict:
    return {"ttft_ms": ttft * 1e3, "decode_ms": (total - ttft) * 1e3 / (output_len - 1),
            "batch_tok_s": batch * output_len / total8,
            "batch_decode_tok_s": batch * (output_len - 1) / (total8 - first8)}


def run_kvengine(model: str, prompts: dict, output_len: int, threads: int) -> dict[str, float]:
    import asyncio

    from launch.client import AsyncEngineClient
    from launch.commands.local_server import LocalServer, wait_until_serving
    from protocol import SamplingParams

    async def one(client, prompt: list[int], max_tokens: int, start: float) -> tuple[float, float]:
        """(seconds to its first token, to its last) from start."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        first = None
        async for _ in client.generate(prompt, params):
            first = first or time.perf_counter() - start
        return first or 0.0, time.perf_counter() - start

    async def run(client, batch_prompts, steps) -> tuple[float, float]:
        start = time.perf_counter()
        ends = await asyncio.gather(*(one(client, p, steps, start) for p in batch_prompts))
        return max(first for first, _ in ends), max(last for _, last in ends)

    async def main():
        server = LocalServer()
        server.flags = ["--model", model, "--max-model-len", "2048", "--cpu-threads-bind", f"0-{threads - 1}"]
        server.spawn()
        try:
            await wait_until_serving(server.address, server.proc)
            async with AsyncEngineClient(server.address) as client:
                await run(client, prompts["warmup"][:len(prompts["batch"])], 4)
                await client.reset_prefix_cache()
                ttft, total = await run(client, [prompts["one"]], output_len)
                await client.reset_prefix_cache()
                first8, total8 = await run(client, prompts["batch"], output_len)
                return batch_times(ttft, total, first8, total8, output_len, len(prompts["batch"]))
        finally:
            server.stop()

    return asyncio.run(main())


# ---- the driver -----------------------------------------------------------------------------------


def make_prompts(batch: int, input_len: int, vocab: int, seed: int) -> dict:
    rng = random.Random(seed)

    def tokens() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(input_len)]

    return {"one": tokens(), "batch": [tokens() for _ in range(batch)], "warmup": [tokens() for _ in range(batch)]}


def run_round(engine: str, args: argparse.Namespace, prompts_file: Path) -> tuple[dict | None, float]:
    python = str(Path(args.llamacpp_venv) / "bin" / "python") if engine == "llamacpp" else sys.executable
    cmd = [python, "-m", "bench.llamacpp_bench", "--run", engine, "--model", args.model, "--prompts",
           str(prompts_file), "--output-len", str(args.output_len), "--threads", str(args.threads)]
    with foreign_load() as load:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        print(f"  {engine}: failed (exit {done.returncode}): {done.stderr.strip()[-800:]}", file=sys.stderr)
        return None, load.cores
    return json.loads(lines[-1]), load.cores


def report(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    keys = ["ttft_ms", "decode_ms", "batch_tok_s", "batch_decode_tok_s"]
    print(f"\n{args.model}: {args.threads} threads; batch 1: {args.input_len}-token prompt, TTFT and decode ms/token "
          f"over {args.output_len} tokens; batch {args.batch_size}: output tok/s (whole batch, decode only); "
          "medians of clean runs")
    print(f"{'engine':<10} {'runs':>4} {'TTFT ms':>9} {'decode ms/tok':>14} {'batch tok/s':>12} {'decode tok/s':>13}")
    for engine, runs in results.items():
        if runs:
            m = [statistics.median(r[k] for r in runs) for k in keys]
            print(f"{engine:<10} {len(runs):>4} {m[0]:>9.1f} {m[1]:>14.2f} {m[2]:>12.1f} {m[3]:>13.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llamacpp-venv", help="venv with llama-cpp-python (without it only kvengine runs)")
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list from {','.join(ENGINES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-foreign-load", type=float, default=0.2, help="cores other processes may use during a run")
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:
        prompts = json.loads(Path(args.prompts).read_text())
        runner = run_llamacpp if args.run == "llamacpp" else run_kvengine
        print(json.dumps(runner(args.model, prompts, args.output_len, args.threads)))
        return 0

    from protocol.model.source import raw_config

    engines = [e for e in args.engines.split(",") if e and (args.llamacpp_venv or e != "llamacpp")]
    prompts_file = Path(tempfile.mkdtemp(prefix="llamacpp-bench-")) / "prompts.json"
    vocab = raw_config(args.model)["vocab_size"]
    prompts_file.write_text(json.dumps(make_prompts(args.batch_size, args.input_len, vocab, 0)))

    def clean_run(engine: str):
        return lambda r: clean_round(engine, r, args.max_foreign_load, lambda: run_round(engine, args, prompts_file))

    report(interleaved({engine: clean_run(engine) for engine in engines}, args.rounds), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
