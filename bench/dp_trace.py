"""Prefix-aware vs round-robin routing over data-parallel engine cores, on the Mooncake conversation trace.

Replays the trace (or its first --limit requests) through `kvengine simulate`'s DP replay: N real engine
cores with SimExecutors on one simulated clock behind the real router (launch/data_parallel/routing.py), at the same
total KV capacity for every policy (each engine gets total / N). Prints, per capacity and policy, the
prefix-cache hit rate (total and per engine), and the simulated TTFT p50 / p99. A one-engine replay with
the whole capacity is the reference (one shared cache, a quarter of the compute at DP 4). The replay is
deterministic, so each figure is one run; the wall time is the only noisy column.

    python -m bench.dp_trace --limit 4000 --kv-cache-tokens 4M 16M
"""

import argparse
import sys
from pathlib import Path

from launch.commands.simulate import _tokens
from launch.simulate.dp_replay import DPReplay, DPResult
from launch.simulate.replay import SimConfig
from launch.simulate.tokens import TokenSynthesizer
from launch.simulate.trace import read_trace
from protocol.config import engine_config

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f}"


def row(capacity: int, r: DPResult) -> str:
    per_engine = " ".join(f"{e.hit_rate:.1%}" for e in r.engines)
    return (f"{capacity:>12,} {r.num_engines:>3} {r.router_policy:>12} {r.hit_rate:>8.2%} {ms(r.ttft_p50_s):>9} "
            f"{ms(r.ttft_p99_s):>10} {r.num_rejected:>5} {sum(e.num_preemptions for e in r.engines):>8,} "
            f"{r.wall_time_s:>6.0f}s  {per_engine}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=None, help="the first N requests (default: the whole trace)")
    p.add_argument("--kv-cache-tokens", type=_tokens, nargs="+", default=[4 * 10**6, 16 * 10**6],
                   help="total KV capacities over all engines (default: 4M 16M)")
    p.add_argument("-dp", "--data-parallel-size", type=int, default=4)
    p.add_argument("--policies", nargs="+", default=["prefix", "round-robin"])
    p.add_argument("--no-reference", action="store_true", help="skip the one-engine replay")
    args = p.parse_args()
    requests = read_trace(args.trace, args.limit)
    config = engine_config(prefix_caching_hash_algo="xxhash")  # the routing compares hashes, not their strength
    synthesizer = TokenSynthesizer(0)
    print(f"{len(requests):,} requests of {args.trace} ({requests[-1].timestamp / 60000:.1f} min of arrivals), "
          "default cost model, block size 16", flush=True)
    print(f"{'KV tokens':>12} {'DP':>3} {'policy':>12} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>10} {'rej':>5} "
          f"{'preempt':>8} {'wall':>7}  per-engine hit rate", flush=True)
    for capacity in args.kv_cache_tokens:
        sim = SimConfig(kv_cache_tokens=capacity)
        runs = [] if args.no_reference else [(1, "prefix")]
        runs += [(args.data_parallel_size, policy) for policy in args.policies]
        for n, policy in runs:
            result = DPReplay(requests, config, sim, n, policy, synthesizer).run()
            problems = result.checks()
            print(row(capacity, result) + (f"  CHECK FAILED: {problems}" if problems else ""), flush=True)
    print("ms columns: simulated TTFT in milliseconds; one infinite cache would hit "
          f"{result.ceiling_hit_rate:.2%}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
