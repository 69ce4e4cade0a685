"""`kvengine simulate`: replay a Mooncake trace through the real engine core on a simulated clock.

Answers "how many KV blocks for this traffic, and what prefix-cache hit rate?" without a model or
a GPU: the scheduler and the KV ledger are the ones `serve` runs, with serve's engine flags; the
model is replaced by a cost model (launch/simulate/ holds the replay, the token synthesis and the
defaults).
"""

import argparse
import json
import logging
import sys
from dataclasses import replace

from tqdm import tqdm

from launch.commands.config_args import add_config_args, config_from_args
from launch.commands.local_server import Interrupted
from launch.commands.stop_signals import raise_on_stop_signals
from launch.simulate.ceiling import count_prefix_hits
from launch.simulate.dp_replay import DPReplay
from launch.simulate.executor import (
    DEFAULT_COST_PER_DECODE_TOKEN,
    DEFAULT_DECODE_COST_PER_STEP,
    DEFAULT_PREFILL_COST_PER_TOKEN,
    CostModel,
)
from launch.simulate.replay import Replay, SimConfig, check_settings
from launch.simulate.report import dp_result_table, plot_sweep, result_table, sweep_table
from launch.simulate.result import SimResult
from launch.simulate.sweep import log_spaced, monotonic_violations, sweep
from launch.simulate.tier import DEFAULT_READ_COST_PER_TOKEN, TierModel
from launch.simulate.trace import TRACE_BLOCK_TOKENS, TraceRequest, read_trace
from protocol.config import AREA_OF, EngineConfig, with_settings

ENGINE_AREAS = ("model", "cache", "scheduler", "parallel")
# Of the parallel settings, a replay takes the data-parallel ones (N engine cores behind the router).
REPLAY_PARALLEL_SETTINGS = ("data_parallel_size", "router_policy")
# Engine settings that mean nothing without a model: hidden from the help, and refused rather than ignored.
NO_MODEL_SETTINGS = ("model", "dtype", "gpu_memory_utilization", "kv_cache_memory_bytes", "kv_disk_path", "kv_disk_bytes",
                     *(name for name, area in AREA_OF.items()
                       if area == "parallel" and name not in REPLAY_PARALLEL_SETTINGS))
# The engine flags whose meaning a replay changes.
SIMULATE_HELP = {
    "--max-model-len": "longest prompt + output in tokens; default: the longest request of the trace, "
                       "or the whole cache if smaller",
    "--block-size": f"tokens per KV block, must divide {TRACE_BLOCK_TOKENS} (default: %(default)s)",
    "--data-parallel-size": "engine cores replayed behind the router (launch/data_parallel/routing.py) on one simulated clock; "
                            "--kv-cache-tokens is then their total, split evenly (default: %(default)s)",
}


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
    p.add_argument("--kv-cache-tokens", type=_tokens, default=None, metavar="TOKENS",
                   help="usable KV cache size in tokens, e.g. 1e6 or 64k (default: never evict); "
                        "--num-gpu-blocks-override gives the size in blocks instead")
    add_config_args(p, areas=ENGINE_AREAS)
    for flag, text in SIMULATE_HELP.items():
        p._option_string_actions[flag].help = text
    for name in NO_MODEL_SETTINGS:
        p._option_string_actions[f"--{name.replace('_', '-')}"].help = argparse.SUPPRESS
    _add_clock_args(p.add_argument_group("simulated clock"))
    _add_output_args(p.add_argument_group("output"))
    p.set_defaults(func=cmd_simulate)


def _add_clock_args(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times by this (0.5 = twice the request rate; default: %(default)s)")
    g.add_argument("--as-fast-as-possible", action="store_true",
                   help="ignore timestamps: every request arrives at t=0, in trace order (offline replay)")
    g.add_argument("--prefill-cost-per-token", type=float, default=DEFAULT_PREFILL_COST_PER_TOKEN, metavar="S",
                   help="seconds per prefill (or recomputed) token (default: %(default)g, ~100k tokens/s)")
    g.add_argument("--decode-cost-per-step", type=float, default=DEFAULT_DECODE_COST_PER_STEP, metavar="S",
                   help="fixed seconds of every step (default: %(default)g)")
    g.add_argument("--kv-disk-tokens", type=_tokens, default=None, metavar="TOKENS",
                   help="a disk tier of this many tokens behind the memory cache: every computed block is saved "
                        "there, and a prefix that misses memory is loaded from it (default: none)")
    g.add_argument("--kv-disk-read-cost-per-token", type=float, default=DEFAULT_READ_COST_PER_TOKEN, metavar="S",
                   help="seconds to load one token's KV from the disk tier, added to the step that loads it "
                        "(default: %(default)s, 128 KiB a token at 64 GB/s)")
    g.add_argument("--cost-per-decode-token", type=float, default=DEFAULT_COST_PER_DECODE_TOKEN, metavar="S",
                   help="seconds per decoded token in a step (default: %(default)g)")


def _add_output_args(g: argparse._ArgumentGroup) -> None:
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


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, SimConfig]:
    """The engine's settings and the replay's own; ValueError for a combination a replay cannot run."""
    config = config_from_args(args, areas=ENGINE_AREAS)
    for name in NO_MODEL_SETTINGS:
        if _setting(config, name) != _setting(EngineConfig(), name):
            raise ValueError(f"--{name.replace('_', '-')} has no effect: no model runs in a simulation")
    if config.scheduler.async_scheduling:
        raise ValueError("--async-scheduling is not replayed: the simulated clock prices one step at a time")
    if args.kv_cache_tokens is not None and config.cache.num_gpu_blocks_override is not None:
        raise ValueError("give --kv-cache-tokens or --num-gpu-blocks-override, not both")
    sim = SimConfig(
        kv_cache_tokens=args.kv_cache_tokens,
        time_scale=args.time_scale,
        as_fast_as_possible=args.as_fast_as_possible,
        cost_model=CostModel(args.prefill_cost_per_token, args.decode_cost_per_step, args.cost_per_decode_token),
        output_len_cap=args.output_len_cap,
        seed=args.seed,
        check_executor=args.check_executor,
        kv_disk=None if args.kv_disk_tokens is None else TierModel(
            args.kv_disk_tokens, args.kv_disk_read_cost_per_token, config.cache.kv_disk_eviction),
    )
    check_settings(config, sim)
    return config, sim


def _setting(config: EngineConfig, name: str) -> object:
    return getattr(getattr(config, AREA_OF[name]), name)


def cmd_simulate(args: argparse.Namespace) -> int:
    """SIGINT or SIGTERM stops a replay with one line and exit code 130 / 143."""
    raise_on_stop_signals()
    try:
        return _simulate(args)
    except Interrupted as e:
        return _fail(str(e), e.exit_code)


def _simulate(args: argparse.Namespace) -> int:
    try:
        config, sim = configs_from_args(args)
        requests = read_trace(args.trace, args.limit)
    except (ValueError, OSError) as e:  # TraceError is a ValueError
        return _fail(str(e), 2)
    if not requests:
        return _fail("the trace has no requests", 2)
    if args.plot and not args.sweep:
        return _fail("--plot needs --sweep", 2)
    data_parallel = config.parallel.data_parallel_size > 1
    if data_parallel and (args.sweep or args.check_ceiling):
        return _fail("--sweep and --check-ceiling replay one engine core; drop --data-parallel-size", 2)
    # Requests longer than the cache can hold are rejected one by one; the table counts them instead.
    logging.getLogger("engine_core.scheduler").setLevel(logging.ERROR)
    try:
        run = _run_data_parallel if data_parallel else _run_sweep if args.sweep else _run_once
        problems = run(args, requests, config, sim)
    except (ValueError, RuntimeError) as e:
        return _fail(str(e), 1)
    if problems and not args.json:
        for p in problems:
            print(f"CHECK FAILED: {p}", file=sys.stderr)
    return 1 if problems else 0


def _fail(message: str, rc: int) -> int:
    print(f"kvengine simulate: {message}", file=sys.stderr)
    return rc


def _run_sweep(args: argparse.Namespace, requests: list[TraceRequest], config: EngineConfig,
               sim: SimConfig) -> list[str]:
    progress = not args.no_progress

    def show(r: SimResult) -> None:
        if progress and not args.json:
            print(f"  {r.kv_cache_tokens:>14,} tokens: hit rate {r.hit_rate:.2%}", file=sys.stderr)

    capacities = log_spaced(args.sweep_min, args.sweep_max, args.sweep_points)
    results = sweep(requests, config, sim, capacities, progress=progress, on_result=show)
    problems = [f"{r.kv_cache_tokens:,} tokens: {p}" for r in results for p in r.checks()]
    problems += monotonic_violations(results)
    if args.plot:
        plot_sweep(results, args.plot, f"{args.trace.rsplit('/', 1)[-1]}, block size {config.cache.block_size}")
    if args.json:
        print(json.dumps({"sweep": [r.to_dict() for r in results], "problems": problems}, indent=2))
    else:
        print(sweep_table(results))
        if args.plot:
            print(f"plot written to {args.plot}")
    return problems


def _run_once(args: argparse.Namespace, requests: list[TraceRequest], config: EngineConfig,
              sim: SimConfig) -> list[str]:
    progress = not args.no_progress
    hits = count_prefix_hits(requests, config.cache.block_size)
    result = Replay(requests, config, sim, hits).run(progress, keep_per_request=args.check_ceiling)
    problems = result.checks()
    out: dict = {"result": result.to_dict()}
    if args.check_ceiling:
        out["ceiling_check"], ceiling_problems = _check_ceiling(requests, config, sim, hits, progress)
        problems += ceiling_problems
    out["problems"] = problems
    if args.json:
        print(json.dumps(out, indent=2))
        return problems
    print(result_table(result))
    if args.check_ceiling:
        c = out["ceiling_check"]
        print(f"ceiling check: direct count {c['direct_count_tokens']:,} tokens, infinite replay "
              f"{c['infinite_replay_tokens']:,} tokens, per request equal: {c['per_request_equal']}")
    return problems


def _run_data_parallel(args: argparse.Namespace, requests: list[TraceRequest], config: EngineConfig,
                       sim: SimConfig) -> list[str]:
    parallel = config.parallel
    replay = DPReplay(requests, config, sim, parallel.data_parallel_size, parallel.router_policy)
    bar = None if args.no_progress else tqdm(total=len(requests), unit="req", file=sys.stderr, dynamic_ncols=True,
                                             desc=f"simulate DP {parallel.data_parallel_size} {parallel.router_policy}")
    try:
        result = replay.run(None if bar is None else bar.update)
    finally:
        if bar is not None:
            bar.close()
    problems = result.checks()
    if args.json:
        print(json.dumps({"result": result.to_dict(), "problems": problems}, indent=2))
    else:
        print(dp_result_table(result))
    return problems


def _check_ceiling(requests: list[TraceRequest], config: EngineConfig, sim: SimConfig, hits: list[int],
                   progress: bool) -> tuple[dict, list[str]]:
    """Replay with a pool too large to evict: its hits must equal the direct count, request by request."""
    infinite = Replay(requests, with_settings(config, num_gpu_blocks_override=None),
                      replace(sim, kv_cache_tokens=None), hits).run(progress, keep_per_request=True)
    agree = infinite.per_request_cached_tokens == hits
    check = {
        "direct_count_tokens": sum(hits),
        "infinite_replay_tokens": infinite.num_cached_tokens,
        "per_request_equal": agree,
        "infinite_replay_preemptions": infinite.num_preemptions,
        "infinite_replay_wall_time_s": infinite.wall_time_s,
    }
    problems = [] if agree else ["the infinite-cache replay disagrees with the direct count"]
    return check, problems + [f"infinite replay: {p}" for p in infinite.checks()]
