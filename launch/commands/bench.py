"""`kvengine bench`: a request-feeding load generator with a results table.

Connects to a running server, or starts its own with the engine flags. Workloads: random prompts,
prompts sharing a prefix, and multi-turn conversations whose every turn resends the history.
"""

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from launch.client import AsyncEngineClient, EngineDeadError, install_uvloop
from launch.commands.config_args import add_config_args, config_from_args
from launch.commands.http_stream import HttpError, get_json, post_sse
from launch.commands.local_server import (
    LOCAL_SERVER_AREAS,
    Interrupted,
    LocalServer,
    ServerStartError,
    run_until_signal,
)
from launch.commands.percentiles import percentile
from protocol import SamplingParams, SchedulerStats
from protocol.config import EngineConfig, ServerConfig
from protocol.model.check import check_model


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test a server and print throughput and latency",
                       description="Without --connect, starts its own server with the engine flags below; that "
                                   "server stops with this command, also when it is killed. SIGINT / SIGTERM: "
                                   "one line and exit code 130 / 143.")
    p.add_argument("--connect", metavar="ADDRESS", default=None, help="address of a running `kvengine serve`")
    p.add_argument("--backend", choices=["kvengine", "openai"], default="kvengine",
                   help="kvengine: the native ZeroMQ client; openai: streamed /v1/completions of any "
                        "OpenAI-compatible server at --base-url (prompts sent as token ids)")
    p.add_argument("--base-url", default=None, help="with --backend openai: e.g. http://127.0.0.1:8000")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="with --backend openai: sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    p.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn"], default="random")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (multi-turn: conversations)")
    p.add_argument("--input-len", type=int, default=512, help="prompt tokens (shared-prefix: prefix included)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request (EOS ignored)")
    p.add_argument("--prefix-len", type=int, default=384, help="shared-prefix: tokens every prompt starts with")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    p.add_argument("--vocab-size", type=int, default=1024, help="random token ids are drawn below this")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrivals per second (default: all at once)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight (default: all at once, up to a server's "
                           "default per-client limit, --max-client-requests)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw KV usage, cached-free blocks, running/waiting requests and throughput over time "
                        "(needs matplotlib: pip install 'kvengine[plot]')")
    p.add_argument("--stats-period", type=float, default=0.5, help="seconds between stats samples for --plot")
    p.add_argument("--server-log", default=None, help="write the started server's log here (default: stderr)")
    add_config_args(p, LOCAL_SERVER_AREAS)
    p.set_defaults(func=cmd_bench)


@dataclass
class RequestResult:
    ttft: float
    latency: float
    output_tokens: int
    finish_reason: str | None
    itls: list[float] = field(default_factory=list)


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.vocab_size) for _ in range(n)]

    if args.workload == "shared-prefix":
        prefix = tokens(args.prefix_len)
        return [prefix + tokens(args.input_len - args.prefix_len) for _ in range(args.num_prompts)]
    return [tokens(args.input_len) for _ in range(args.num_prompts)]


async def run_one(client: AsyncEngineClient, prompt: list[int],
                  params: SamplingParams) -> tuple[RequestResult, list[int]]:
    start = time.perf_counter()
    last = start
    result = RequestResult(ttft=0.0, latency=0.0, output_tokens=0, finish_reason=None)
    output: list[int] = []
    async for out in client.generate(prompt, params):
        now = time.perf_counter()
        if out.new_token_ids:
            if not output:
                result.ttft = now - start
            else:
                result.itls.append(now - last)
            last = now
            output += out.new_token_ids
        result.finish_reason = out.finish_reason
    result.latency = time.perf_counter() - start
    result.output_tokens = len(output)
    return result, output


async def run_one_openai(url: str, model: str, prompt: list[int], args: argparse.Namespace,
                         rng: random.Random) -> tuple[RequestResult, list[int]]:
    """One streamed completion; its output stands in as random ids of the same length (text has no ids)."""
    payload = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
               "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if args.temperature > 0:
        payload["seed"] = args.seed
    start = last = time.perf_counter()
    result = RequestResult(ttft=0.0, latency=0.0, output_tokens=0, finish_reason=None)
    chunks = 0
    async for event in post_sse(url, payload, args.api_key):
        now = time.perf_counter()
        for choice in event.get("choices") or []:
            if choice.get("text"):
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last, chunks = now, chunks + 1
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
        if event.get("usage"):
            result.output_tokens = event["usage"]["completion_tokens"]
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    return result, [rng.randrange(args.vocab_size) for _ in range(result.output_tokens)]


async def drive(send: Callable[[list[int]], Awaitable[tuple[RequestResult, list[int]]]],
                args: argparse.Namespace) -> tuple[list[RequestResult], float]:
    rng = random.Random(args.seed)
    # One connection may hold at most a server's --max-client-requests: more would be refused as overloaded.
    limit = asyncio.Semaphore(args.max_concurrency or ServerConfig().max_client_requests)
    results: list[RequestResult] = []
    turns = args.turns if args.workload == "multi-turn" else 1
    bar = tqdm(total=args.num_prompts * turns, desc="requests", unit="req", file=sys.stderr, disable=args.json)

    async def conversation(prompt: list[int]) -> None:
        history = prompt
        for _ in range(turns):
            async with limit:
                result, output = await send(history)
            results.append(result)
            bar.update()
            history = history + output + [rng.randrange(args.vocab_size) for _ in range(args.input_len // 4)]

    start = time.perf_counter()
    tasks = []
    try:
        for prompt in make_prompts(args, rng):
            tasks.append(asyncio.create_task(conversation(prompt)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
    finally:
        bar.close()
    return results, time.perf_counter() - start


def percentiles(values: list[float]) -> dict[str, float]:
    return {f"p{q}": percentile(values, q) or 0.0 for q in (50, 90, 99)}


def summarize(results: list[RequestResult], elapsed: float, before: SchedulerStats | None,
              after: SchedulerStats | None) -> dict:
    """Stats None (another engine over HTTP): no prefix-cache hit rate nor preemption count."""
    out_tokens = sum(r.output_tokens for r in results)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    engine: dict = {"prefix_cache_hit_rate": None, "preemptions": None}
    if before is not None and after is not None:
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        engine = {"prefix_cache_hit_rate": hits / queries if queries else 0.0,
                  "preemptions": after.num_preemptions - before.num_preemptions}
    return {
        "requests": len(results),
        "failed": sum(r.finish_reason not in ("length", "stop") for r in results),
        "duration_s": elapsed,
        "requests_per_s": len(results) / elapsed,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "ttft_ms": {k: v * 1000 for k, v in percentiles([r.ttft for r in results]).items()},
        "tpot_ms": {k: v * 1000 for k, v in percentiles(tpots).items()},
        **engine,
    }


def format_table(summary: dict, args: argparse.Namespace) -> str:
    rows = [
        ("workload", f"{args.workload}, {summary['requests']} requests"),
        ("failed requests", summary["failed"]),
        ("duration", f"{summary['duration_s']:.2f} s"),
        ("requests/s", f"{summary['requests_per_s']:.2f}"),
        ("output tokens/s", f"{summary['output_tokens_per_s']:.1f}"),
    ]
    for name in ("ttft_ms", "tpot_ms"):
        label = "time to first token" if name == "ttft_ms" else "time per output token"
        rows += [(f"{label} {p} (ms)", f"{v:.2f}") for p, v in summary[name].items()]
    hit_rate, preemptions = summary["prefix_cache_hit_rate"], summary["preemptions"]
    rows += [("prefix-cache hit rate", "n/a" if hit_rate is None else f"{hit_rate:.1%}"),
             ("preemptions", "n/a" if preemptions is None else preemptions)]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


async def sample_stats(client: AsyncEngineClient, period: float, samples: list[tuple[float, SchedulerStats]]):
    """Poll the server's stats until cancelled, for --plot."""
    start = time.perf_counter()
    while True:
        samples.append((time.perf_counter() - start, await client.get_stats()))
        await asyncio.sleep(period)


async def _bench_openai(args: argparse.Namespace) -> tuple[dict, list[tuple[float, SchedulerStats]]]:
    base = args.base_url.rstrip("/").removesuffix("/v1")
    model = (await get_json(f"{base}/v1/models", args.api_key))["data"][0]["id"]
    rng = random.Random(args.seed + 1)
    results, elapsed = await drive(
        lambda prompt: run_one_openai(f"{base}/v1/completions", model, prompt, args, rng), args)
    return summarize(results, elapsed, None, None), []


async def _bench(args: argparse.Namespace, config: EngineConfig) -> tuple[dict, list[tuple[float, SchedulerStats]]]:
    if args.backend == "openai":
        return await _bench_openai(args)
    params = SamplingParams(max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True,
                            seed=args.seed if args.temperature > 0 else None)
    server = contextlib.nullcontext() if args.connect else LocalServer(config, args.server_log)
    samples: list[tuple[float, SchedulerStats]] = []
    async with server as local, AsyncEngineClient(local.address if local else args.connect) as client:
        await client.wait_ready()
        before = await client.get_stats()
        sampler = asyncio.create_task(sample_stats(client, args.stats_period, samples)) if args.plot else None
        results, elapsed = await drive(lambda prompt: run_one(client, prompt, params), args)
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        after = await client.get_stats()
    return summarize(results, elapsed, before, after), samples


def cmd_bench(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args, LOCAL_SERVER_AREAS)
        check_model(config.model.model)  # one line for a --model that cannot load, before any process starts
    except ValueError as e:
        print(f"kvengine bench: {e}", file=sys.stderr)
        return 2
    if args.backend == "openai" and (args.base_url is None or args.plot or args.connect):
        print("kvengine bench: --backend openai needs --base-url, and takes neither --connect nor --plot",
              file=sys.stderr)
        return 2
    if args.plot:
        from launch.commands.plot import check_matplotlib

        check_matplotlib()
    install_uvloop()
    try:
        summary, samples = run_until_signal(_bench(args, config))
    except (EngineDeadError, ServerStartError, HttpError, OSError) as e:
        print(f"kvengine bench: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"kvengine bench: {e}", file=sys.stderr)
        return e.exit_code
    if args.plot:
        from launch.commands.plot import plot_run

        plot_run(samples, args.plot, title=f"kvengine bench: {args.workload}, {summary['requests']} requests")
        print(f"plot written to {args.plot}", file=sys.stderr)
    print(json.dumps(summary, indent=2) if args.json else format_table(summary, args))
    return 0 if summary["failed"] == 0 else 1
