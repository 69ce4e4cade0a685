"""Benchmark of the KV block ledger (engine_core/kv_cache): prints figures, asserts nothing.

Replays a seeded synthetic trace through KVCacheManager the way a scheduler would:
  - ~2,000 requests, prompts of 200-2,000 tokens, half of them sharing one 1,024-token prefix,
    100-300 decode steps each, at most 64 running, block size 16, 4,096 blocks;
  - admission: get_computed_blocks + allocate_slots(full_sequence_must_fit=True) of the whole prompt
    (no chunking), FIFO, the waiting pass stops at the first refusal;
  - decode: one token per running request per step, allocate_slots(req, 1); when a slot cannot be
    had, the newest running request is preempted (free, recompute later) and the call is retried;
  - free on finish.
Then the same trace (shorter with --quick) at pool sizes of 10^4, 10^5 and 10^6 blocks, to show that
a call's cost follows the blocks it touches, not the size of the pool.

    python -m bench.ledger_bench            # full run
    python -m bench.ledger_bench --quick    # a few seconds
"""

import argparse
import gc
import random
import statistics
import sys
from collections import deque

from bench.timing import CallTimes, stopwatch
from engine_core.kv_cache.hashing import get_hash_fn, get_request_block_hasher, hash_block_tokens
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

VOCAB = 32_000


def make_trace(args, num_requests):
    """[(prompt token ids, number of output tokens)], seeded."""
    rng = random.Random(args.seed)
    prefix = [rng.randrange(VOCAB) for _ in range(args.shared_prefix)]
    trace = []
    for i in range(num_requests):
        if i % 2 == 0:  # shares the prefix: needs at least one token of its own
            length = rng.randint(max(args.min_prompt, args.shared_prefix + 1), args.max_prompt)
            prompt = prefix + [rng.randrange(VOCAB) for _ in range(length - args.shared_prefix)]
        else:
            length = rng.randint(args.min_prompt, args.max_prompt)
            prompt = [rng.randrange(VOCAB) for _ in range(length)]
        trace.append((prompt, rng.randint(args.min_decode, args.max_decode)))
    return trace


class Replay:
    def __init__(self, args, num_blocks, trace):
        self.args = args
        spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=8, head_size=128, dtype_bytes=2)
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(["layers"], spec)])
        max_len = args.max_prompt + args.max_decode + 1
        with stopwatch() as lap:
            self.mgr = KVCacheManager(config, max_model_len=max_len, enable_caching=True, max_num_batched_tokens=max_len)
        self.build_s = lap.wall
        if args.gc_freeze:
            gc.collect()
            gc.freeze()
        self.hasher = get_request_block_hasher(args.block_size, get_hash_fn(args.hash))
        self.trace = trace
        self.rng = random.Random(args.seed + 1)
        self.prefill = CallTimes(self.mgr.allocate_slots)  # at admission (successful or not)
        self.decode = CallTimes(self.mgr.allocate_slots)  # allocate_slots(req, 1)
        self.lookup = CallTimes(self.mgr.get_computed_blocks)
        self.free = CallTimes(self.mgr.free)
        self.step_s_at_full: list[float] = []  # ledger work of one decode step with max_running running
        self.num_preemptions = 0
        self.num_steps = 0

    def run(self):
        mgr, args = self.mgr, self.args
        waiting = deque()
        for i, (prompt, num_out) in enumerate(self.trace):
            req = Request(f"req-{i}", list(prompt), block_hasher=self.hasher)
            req.target_output = num_out
            waiting.append(req)
        running: list[Request] = []
        num_finished = 0
        while waiting or running:
            self.num_steps += 1
            # ---- decode: one token for every request that was already running
            full = len(running) == args.max_running
            marks = len(self.decode.wall), len(self.free.wall)
            i = 0
            while i < len(running):
                req = running[i]
                out = self.decode(req, 1)
                if out is None:  # recompute preemption of the newest running request, then retry
                    victim = running.pop()
                    self.free(victim)
                    victim.status = RequestStatus.PREEMPTED
                    victim.num_computed_tokens = 0
                    victim.num_preemptions += 1
                    self.num_preemptions += 1
                    waiting.appendleft(victim)
                    continue  # retry the same index (if the victim was this request, the loop ends)
                req.num_computed_tokens += 1
                req.append_output_token_ids([self.rng.randrange(VOCAB)])
                if req.num_output_tokens >= req.target_output:
                    self.free(req)
                    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    running.pop(i)
                    num_finished += 1
                    continue
                i += 1
            if full:
                self.step_s_at_full.append(sum(self.decode.wall[marks[0]:]) + sum(self.free.wall[marks[1]:]))
            # ---- admission: whole prompts, FIFO, stop at the first refusal
            while waiting and len(running) < args.max_running:
                req = waiting[0]
                hits, num_hit = self.lookup(req)
                out = self.prefill(
                    req, req.num_tokens - num_hit, num_hit, hits,
                    full_sequence_must_fit=True, has_scheduled_reqs=bool(running),
                )
                if out is None:
                    if not running:
                        raise RuntimeError(f"{req.request_id} can never fit in {mgr.block_pool.num_gpu_blocks} blocks")
                    break
                waiting.popleft()
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = req.num_tokens
                req.append_output_token_ids([self.rng.randrange(VOCAB)])  # the token the prefill samples
                running.append(req)
        assert num_finished == len(self.trace)
        assert mgr.get_num_free_blocks() == mgr.block_pool.num_gpu_blocks - 1
        return self

    # ---- figures
    def all_alloc_s(self):
        return self.prefill.wall + self.decode.wall

    def ledger_calls(self):
        return sum(len(c.wall) for c in (self.prefill, self.decode, self.lookup, self.free))

    def ledger_s(self):
        return sum(sum(c.wall) for c in (self.prefill, self.decode, self.lookup, self.free))


def us(values, fn):
    """fn of the values (seconds) in microseconds."""
    return fn(values) * 1e6 if values else float("nan")


def table(rows, headers):
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    line = "  ".join(f"{{:>{w}}}" for w in widths)
    print(line.format(*headers))
    print(line.format(*("-" * w for w in widths)))
    for row in rows:
        print(line.format(*row))


def hash_cost(block_size, n_blocks=20_000):
    rng = random.Random(0)
    blocks = [[rng.randrange(VOCAB) for _ in range(block_size)] for _ in range(n_blocks)]
    out = {}
    for name in ("sha256", "xxhash"):
        fn = get_hash_fn(name)
        parent = None
        with stopwatch() as lap:
            for tokens in blocks:
                parent = hash_block_tokens(fn, parent, tokens)
        out[name] = lap.wall / n_blocks * 1e6
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--min-prompt", type=int, default=200)
    p.add_argument("--max-prompt", type=int, default=2000)
    p.add_argument("--shared-prefix", type=int, default=1024)
    p.add_argument("--min-decode", type=int, default=100)
    p.add_argument("--max-decode", type=int, default=300)
    p.add_argument("--hash", choices=("sha256", "xxhash"), default="sha256", help="prefix-cache hash of the trace")
    p.add_argument("--pool-sizes", type=int, nargs="*", default=[10**4, 10**5, 10**6])
    p.add_argument("--pool-requests", type=int, default=None,
                   help="requests per pool-size run (default: --requests, or 300 with --quick)")
    p.add_argument("--gc-freeze", action="store_true",
                   help="gc.freeze() after building each pool (as an engine would after start-up), so full "
                        "collections stop walking every KVCacheBlock")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="200 requests, 100 per pool-size run")
    args = p.parse_args()
    if args.quick:
        args.requests = min(args.requests, 200)
    pool_requests = args.pool_requests or (100 if args.quick else min(args.requests, 500))

    print(f"kvengine ledger bench: {args.requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
          f"(half share a {args.shared_prefix}-token prefix), {args.min_decode}-{args.max_decode} decode steps, "
          f"<= {args.max_running} running, block size {args.block_size}, {args.num_blocks} blocks, "
          f"hash {args.hash}, seed {args.seed}, python {sys.version.split()[0]}")

    trace = make_trace(args, args.requests)
    with stopwatch() as lap:
        r = Replay(args, args.num_blocks, trace).run()
    wall = lap.wall
    stats = r.mgr.prefix_cache_stats
    print(f"\nmain trace: {r.num_steps} steps, {r.num_preemptions} preemptions, replay wall {wall:.1f} s "
          f"(ledger {r.ledger_s():.2f} s of it)\n")
    rows = []
    for name, values in (("allocate_slots prefill", r.prefill.wall), ("allocate_slots decode", r.decode.wall),
                         ("allocate_slots all", r.all_alloc_s()), ("get_computed_blocks", r.lookup.wall),
                         ("free", r.free.wall)):
        rows.append((name, f"{len(values):,}", f"{us(values, statistics.median):.2f}",
                     f"{us(values, statistics.fmean):.2f}", f"{us(values, max):.1f}"))
    table(rows, ("call", "count", "median us", "mean us", "max us"))
    calls_per_s = r.ledger_calls() / r.ledger_s()
    print(f"\nledger calls per second (calls / time inside the ledger): {calls_per_s:,.0f}")
    if r.step_s_at_full:
        print(f"ledger work per decode step at {args.max_running} running: "
              f"median {us(r.step_s_at_full, statistics.median):.0f} us, "
              f"mean {us(r.step_s_at_full, statistics.fmean):.0f} us, "
              f"p99 {sorted(r.step_s_at_full)[int(0.99 * (len(r.step_s_at_full) - 1))] * 1e6:.0f} us "
              f"over {len(r.step_s_at_full):,} steps (target < 1000 us)")
    else:
        print(f"ledger work per decode step at {args.max_running} running: no step had {args.max_running} running")
    print(f"prefix-cache hit rate: {stats.hits / max(stats.queries, 1):.1%} of {stats.queries:,} queried tokens "
          f"({stats.requests:,} admissions)")

    hc = hash_cost(args.block_size)
    print(f"hash cost per {args.block_size}-token block: sha256 {hc['sha256']:.2f} us, xxhash {hc['xxhash']:.2f} us")

    if args.pool_sizes:
        print(f"\npool size scaling: the first {pool_requests} requests of the trace, same driver\n")
        sub = trace[:pool_requests]
        rows, per_call, medians = [], {}, {}
        for size in args.pool_sizes:
            gc.collect()
            rr = Replay(args, size, sub).run()
            allc = rr.all_alloc_s()
            per_call[size] = statistics.fmean(allc)
            rows.append((f"{size:,}", f"{rr.build_s:.2f}", f"{us(rr.prefill.wall, statistics.median):.2f}",
                         f"{us(rr.decode.wall, statistics.median):.2f}", f"{us(allc, statistics.median):.2f}",
                         f"{us(allc, statistics.fmean):.2f}", f"{rr.num_preemptions}",
                         f"{rr.mgr.prefix_cache_stats.hits / max(rr.mgr.prefix_cache_stats.queries, 1):.1%}"))
            medians[size] = statistics.median(allc)
            if args.gc_freeze:
                gc.unfreeze()
            del rr
        table(rows, ("blocks", "build s", "prefill med us", "decode med us", "alloc med us", "alloc mean us",
                     "preempt", "hit rate"))
        lo, hi = min(per_call), max(per_call)
        if lo != hi:
            print(f"\nallocate_slots cost per call, {hi:,} vs {lo:,} blocks: mean {per_call[hi] / per_call[lo]:.2f}x, "
                  f"median {medians[hi] / medians[lo]:.2f}x (target <= 1.3x)"
                  + ("" if args.gc_freeze else "; see --gc-freeze for the part that is the garbage collector"))


if __name__ == "__main__":
    main()
