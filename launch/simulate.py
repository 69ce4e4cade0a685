"""`kvengine simulate`: replay a Mooncake trace through the real engine core on a simulated clock.

Answers "how many KV blocks for this traffic, and what prefix-cache hit rate?" without a model or
a GPU: the scheduler and the KV ledger are the ones `serve` runs; the model is replaced by a cost
model (see engine_core/simulate.py for the executor, the token synthesis and the defaults).
"""

import argparse
import dataclasses
import json
import logging
import sys

from engine_core.simulate import (
    DEFAULT_COST_PER_DECODE_TOKEN,
    DEFAULT_DECODE_COST_PER_STEP,
    DEFAULT_PREFILL_COST_PER_TOKEN,
    TRACE_BLOCK_TOKENS,
    CostModel,
    SimConfig,
    SimResult,
    count_prefix_hits,
    log_spaced,
    monotonic_violations,
    read_trace,
    replay,
    sweep,
)


def _tokens(text: str) -> int:
    """1e6, 1000000, 1_000_000, 1M, 64k."""
    t = text.strip().lower().replace("_", "")
    mult = {"k": 10**3, "m": 10**6, "g": 10**9}.get(t[-1:], 1)
    if mult != 1:
        t = t[:-1]
    try:
        value = float(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"token count must be at least 1, got {text!r}")
    return int(value)


def add_simulate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a Mooncake trace through the engine core on a simulated clock (capacity planning)",
        description="Replay a Mooncake-format trace (JSONL: timestamp ms, input_length, output_length, hash_ids "
        "of 512-token blocks) through the real scheduler and KV ledger, with the model replaced by a cost "
        "model. Prints prefix-cache hit rate (and the infinite-cache ceiling), preemptions, KV usage and "
        "simulated TTFT. Without a KV size the pool is large enough never to evict.",
    )
    p.add_argument("--trace", required=True, help="Mooncake JSONL trace file")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="replay only the first N requests")
    p.add_argument("--output-len-cap", type=int, default=None, metavar="N",
                   help="generate at most N tokens per request (less decode work; prefix hits are unchanged)")
    p.add_argument("--seed", type=int, default=0, help="seed of the token synthesis (default: %(default)s)")

    g = p.add_argument_group("KV cache (as in serve)")
    size = g.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-tokens", type=_tokens, default=None, metavar="TOKENS",
                      help="usable KV cache size in tokens, e.g. 1e6 or 64k (default: never evict)")
    size.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                      help="exactly N KV blocks, the null block included")
    g.add_argument("--block-size", type=int, default=16, help=f"tokens per KV block, must divide {TRACE_BLOCK_TOKENS} "
                   "(default: %(default)s)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prefixes (default: on)")
    g.add_argument("--prefix-caching-hash-algo", choices=["sha256", "xxhash"], default="sha256",
                   help="block hash (default: %(default)s, as serve; xxhash is faster)")

    g = p.add_argument_group("scheduler (as in serve)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest request of the trace, or the whole cache if smaller")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most running requests (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step (default: %(default)s)")

    g = p.add_argument_group("simulated clock")
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times by this (0.5 = twice the request rate; default: %(default)s)")
    g.add_argument("--as-fast-as-possible", action="store_true",
                   help="ignore timestamps: every request arrives at t=0, in trace order (offline replay)")
    g.add_argument("--prefill-cost-per-token", type=float, default=DEFAULT_PREFILL_COST_PER_TOKEN, metavar="S",
                   help="seconds per prefill (or recomputed) token (default: %(default)g, ~100k tokens/s)")
    g.add_argument("--decode-cost-per-step", type=float, default=DEFAULT_DECODE_COST_PER_STEP, metavar="S",
                   help="fixed seconds of every step (default: %(default)g)")
    g.add_argument("--cost-per-decode-token", type=float, default=DEFAULT_COST_PER_DECODE_TOKEN, metavar="S",
                   help="seconds per decoded token in a step (default: %(default)g)")

    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print the results as JSON")
    g.add_argument("--sweep", action="store_true",
                   help="replay once per cache size, log-spaced from --sweep-min to --sweep-max tokens, and print "
                        "hit rate against capacity (like Figure 9 of the Mooncake paper)")
    g.add_argument("--sweep-min", type=_tokens, default=10**4, metavar="TOKENS", help="default: 1e4")
    g.add_argument("--sweep-max", type=_tokens, default=10**8, metavar="TOKENS", help="default: 1e8")
    g.add_argument("--sweep-points", type=int, default=9, help="default: %(default)s")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="with --sweep: plot hit rate vs capacity "
                   "(needs matplotlib: pip install matplotlib)")
    g.add_argument("--check-ceiling", action="store_true",
                   help="also replay with a pool too large to evict and check that its hits equal the direct count")
    g.add_argument("--check-executor", action="store_true",
                   help="also run the ReferenceExecutor each step (rebuilds block tables; slow)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_simulate)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        block_size=args.block_size,
        kv_cache_tokens=args.kv_cache_tokens,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        time_scale=args.time_scale,
        as_fast_as_possible=args.as_fast_as_possible,
        cost_model=CostModel(args.prefill_cost_per_token, args.decode_cost_per_step, args.cost_per_decode_token),
        output_len_cap=args.output_len_cap,
        seed=args.seed,
        check_executor=args.check_executor,
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f} ms"


def result_table(r: SimResult) -> str:
    rows = [
        ("requests", f"{r.num_requests:,} ({r.num_finished:,} finished, {r.num_rejected:,} rejected)"),
        ("prompt tokens", f"{r.num_prompt_tokens:,}"),
        ("prefix-cache hit tokens", f"{r.num_cached_tokens:,}"),
        ("prefix-cache hit rate", f"{r.hit_rate:.2%}" if r.prefix_caching else "- (prefix caching off)"),
        ("infinite-cache hit tokens", f"{r.ceiling_cached_tokens:,}"),
        ("infinite-cache hit rate", f"{r.ceiling_hit_rate:.2%}"),
        ("output tokens", f"{r.num_output_tokens:,}"),
        ("preemptions", f"{r.num_preemptions:,}"),
        ("KV cache", f"{r.kv_cache_tokens:,} tokens ({r.num_blocks:,} blocks of {r.block_size})"),
        ("peak KV usage", f"{r.peak_kv_usage:.1%}"),
        ("mean KV usage", f"{r.mean_kv_usage:.1%}"),
        ("simulated time", f"{r.sim_time_s:,.1f} s in {r.num_steps:,} steps"),
        ("TTFT p50 / p90 / p99", f"{_ms(r.ttft_p50_s)} / {_ms(r.ttft_p90_s)} / {_ms(r.ttft_p99_s)}"),
        ("max_model_len", f"{r.max_model_len:,}"),
        ("block hash", r.hash_algo),
        ("wall time", f"{r.wall_time_s:,.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def sweep_table(results: list[SimResult]) -> str:
    head = f"{'KV tokens':>14} {'blocks':>11} {'hit rate':>9} {'ceiling':>8} {'rejected':>8} {'preempt':>8} " \
           f"{'peak KV':>8} {'TTFT p50':>11} {'TTFT p99':>11} {'wall':>7}"
    lines = [head]
    for r in results:
        lines.append(
            f"{r.kv_cache_tokens:>14,} {r.num_blocks:>11,} {r.hit_rate:>9.2%} {r.ceiling_hit_rate:>8.2%} "
            f"{r.num_rejected:>8,} {r.num_preemptions:>8,} {r.peak_kv_usage:>8.1%} {_ms(r.ttft_p50_s):>11} "
            f"{_ms(r.ttft_p99_s):>11} {r.wall_time_s:>6.0f}s"
        )
    return "\n".join(lines)


def plot_sweep(results: list[SimResult], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    xs = [r.kv_cache_tokens for r in results]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [100 * r.hit_rate for r in results], marker="o", label="replay (LRU, engine ledger)")
    ax.axhline(100 * results[0].ceiling_hit_rate, linestyle="--", color="gray", label="infinite cache")
    ax.set_xscale("log")
    ax.set_xlabel("KV cache capacity (tokens)")
    ax.set_ylabel("prefix cache hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
        requests = read_trace(args.trace, args.limit)
    except (ValueError, OSError) as e:  # TraceError is a ValueError
        print(f"kvengine simulate: {e}", file=sys.stderr)
        return 2
    if not requests:
        print("kvengine simulate: the trace has no requests", file=sys.stderr)
        return 2
    if args.plot and not args.sweep:
        print("kvengine simulate: --plot needs --sweep", file=sys.stderr)
        return 2
    progress = not args.no_progress
    # Requests longer than the cache can hold are rejected one by one; the table counts them instead.
    logging.getLogger("engine_core.scheduler").setLevel(logging.ERROR)
    problems: list[str] = []
    hits = count_prefix_hits(requests, config.block_size)
    try:
        if args.sweep:
            capacities = log_spaced(args.sweep_min, args.sweep_max, args.sweep_points)

            def show(r: SimResult) -> None:
                if progress and not args.json:
                    print(f"  {r.kv_cache_tokens:>14,} tokens: hit rate {r.hit_rate:.2%}", file=sys.stderr)

            results = sweep(requests, config, capacities, progress=progress, on_result=show)
            for r in results:
                problems += [f"{r.kv_cache_tokens:,} tokens: {p}" for p in r.checks()]
            problems += monotonic_violations(results)
            if args.plot:
                plot_sweep(results, args.plot, f"{args.trace.rsplit('/', 1)[-1]}, block size {config.block_size}")
            if args.json:
                print(json.dumps({"sweep": [r.to_dict() for r in results], "problems": problems}, indent=2))
            else:
                print(sweep_table(results))
                if args.plot:
                    print(f"plot written to {args.plot}")
        else:
            result = replay(requests, config, progress=progress, ceiling_hits=hits, keep_per_request=args.check_ceiling)
            problems += result.checks()
            out: dict = {"result": result.to_dict()}
            if args.check_ceiling:
                infinite = replay(
                    requests,
                    dataclasses.replace(config, kv_cache_tokens=None, num_gpu_blocks_override=None),
                    progress=progress,
                    ceiling_hits=hits,
                    keep_per_request=True,
                )
                agree = infinite.per_request_cached_tokens == hits
                out["ceiling_check"] = {
                    "direct_count_tokens": sum(hits),
                    "infinite_replay_tokens": infinite.num_cached_tokens,
                    "per_request_equal": agree,
                    "infinite_replay_preemptions": infinite.num_preemptions,
                    "infinite_replay_wall_time_s": infinite.wall_time_s,
                }
                if not agree:
                    problems.append("the infinite-cache replay disagrees with the direct count")
                problems += [f"infinite replay: {p}" for p in infinite.checks()]
            out["problems"] = problems
            if args.json:
                print(json.dumps(out, indent=2))
            else:
                print(result_table(result))
                if args.check_ceiling:
                    c = out["ceiling_check"]
                    print(f"ceiling check: direct count {c['direct_count_tokens']:,} tokens, infinite replay "
                          f"{c['infinite_replay_tokens']:,} tokens, per request equal: {c['per_request_equal']}")
    except (ValueError, RuntimeError) as e:
        print(f"kvengine simulate: {e}", file=sys.stderr)
        return 1
    if problems and not args.json:
        for p in problems:
            print(f"CHECK FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0
