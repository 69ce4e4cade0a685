"""Where a trace replay spends its time: `kvengine simulate` under cProfile, split by component.

    python -m bench.simulate_bench --trace ../shared/traces/mooncake_conversation_trace.jsonl --limit 1000

Prints the wall time, then cumulative seconds (and share of the profiled run) of: token synthesis,
Request construction (prompt block hashing), decode-time block hashing, prefix lookup, slot
allocation (with hash registration and eviction inside), freeing, the rest of schedule(),
update_from_output, and the model-free executor; and per-unit figures: microseconds per prefill
block registered and per decode slot allocation. cProfile roughly doubles Python-heavy code, so
compare shares, not absolute times, with an unprofiled run (`kvengine simulate` prints its wall time).
"""

import argparse
import cProfile
import pstats
import sys

from bench.timing import stopwatch
from launch.simulate.replay import Replay, SimConfig
from launch.simulate.trace import read_trace
from protocol.config import engine_config


def cumtime(stats: pstats.Stats, file_suffix: str, func: str) -> tuple[float, int]:
    total, calls = 0.0, 0
    for (filename, _line, name), (_cc, nc, _tt, ct, _callers) in stats.stats.items():
        if filename.endswith(file_suffix) and name == func:
            total += ct
            calls += nc
    return total, calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--kv-cache-tokens", type=float, default=1e6)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--hash", choices=["sha256", "xxhash"], default="xxhash")
    p.add_argument("--no-profile", action="store_true", help="time only")
    args = p.parse_args()

    requests = read_trace(args.trace, args.limit)
    config = engine_config(block_size=args.block_size, prefix_caching_hash_algo=args.hash)
    sim = SimConfig(kv_cache_tokens=int(args.kv_cache_tokens))
    if args.no_profile:
        with stopwatch() as lap:
            r = Replay(requests, config, sim).run(progress=True)
        print(f"{len(requests)} requests: {lap.wall:.1f} s wall, hit rate {r.hit_rate:.2%}, "
              f"{r.num_decode_tokens_computed:,} decode tokens, {r.num_steps:,} steps")
        return 0
    prof = cProfile.Profile()  # wall time: run it on a quiet machine, or read the shares
    with stopwatch() as lap:
        prof.enable()
        r = Replay(requests, config, sim).run()
        prof.disable()
    wall = lap.wall
    stats = pstats.Stats(prof)
    total = sum(cumtime(stats, "simulate/replay.py", func)[0] for func in ("__init__", "run"))  # build + run
    parts = [
        ("token synthesis", "simulate/tokens.py", "prompt"),
        ("Request() incl. prompt hashing", "request.py", "__init__"),
        ("decode-time block hashing", "request.py", "append_output_token_ids"),
        ("all block hashing", "hashing.py", "hash_new_blocks"),
        ("prefix lookup", "manager.py", "get_computed_blocks"),
        ("allocate_slots (all)", "manager.py", "allocate_slots"),
        ("  hash registration", "block_pool.py", "cache_full_blocks"),
        ("  get_new_blocks", "block_pool.py", "get_new_blocks"),
        ("  eviction", "block_pool.py", "_evict_cached_block"),
        ("free", "manager.py", "free"),
        ("schedule (all)", "scheduler.py", "schedule"),
        ("  _make_output", "scheduler.py", "_make_output"),
        ("update_from_output", "scheduler.py", "update_from_output"),
        ("executor", "simulate/executor.py", "execute_model"),
    ]
    print(f"{len(requests)} requests, {r.num_steps:,} steps, hit rate {r.hit_rate:.2%}; "
          f"profiled wall {wall:.1f} s")
    print(f"{'component':<34} {'seconds':>9} {'share':>7} {'calls':>11}")
    for label, suffix, func in parts:
        sec, calls = cumtime(stats, suffix, func)
        print(f"{label:<34} {sec:>9.2f} {sec / total:>7.1%} {calls:>11,}")
    alloc, n_alloc = cumtime(stats, "manager.py", "allocate_slots")
    print(f"allocate_slots: {alloc / n_alloc * 1e6:.1f} us per call (profiled); "
          f"prefill blocks computed {r.num_prefill_tokens_computed // args.block_size:,}, "
          f"decode slots {r.num_decode_tokens_computed:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
