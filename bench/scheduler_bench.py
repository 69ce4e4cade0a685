"""Benchmark of one engine-core step (scheduler + ledger): prints figures, asserts nothing.

Runs EngineCore with the model-free ReferenceExecutor (it follows every SchedulerOutput like a
worker: token histories, block tables), so a step's time is the engine core's own work plus a
cheap stand-in for the workers. Two workloads:
  - decode: 256 running requests (prompts of 128 tokens), every step one token each;
  - mixed:  200 requests decoding while new ones (prompts of 500-2,000 tokens, 16 output tokens)
            keep arriving, so every step mixes chunked prefill with decode under a 2,048-token budget.
For each: steps/s and microseconds per step, split into schedule(), the executor, and
update_from_output(); and separately the time to msgspec-encode the SchedulerOutput with
protocol.codec.engine_to_worker_codec() (what MultiprocExecutor sends each step) and its size.

    python -m bench.scheduler_bench            # full run (~1 min)
    python -m bench.scheduler_bench --quick    # a few seconds
"""

import argparse
import gc
import random
import statistics
import sys
import time

from bench.timing import CallTimes
from engine_core.core import EngineCore
from engine_core.executor.reference_executor import ReferenceExecutor
from protocol import EngineCoreRequest, FullAttentionSpec, SamplingParams
from protocol.codec import engine_to_worker_codec
from protocol.config import engine_config

VOCAB = 32_000


class Bench:
    def __init__(self, args, num_blocks: int, max_model_len: int) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        executor = ReferenceExecutor(
            kv_cache_specs={"layers": FullAttentionSpec(args.block_size, 8, 128, 2)},
            vocab_size=VOCAB,
            max_position_embeddings=max_model_len,
        )
        config = engine_config(
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.budget,
            block_size=args.block_size,
            enable_prefix_caching=not args.no_prefix_caching,
            num_gpu_blocks_override=num_blocks,
            check_block_tables=args.check_block_tables,
        )
        self.core = EngineCore(config, executor)
        self.codec = engine_to_worker_codec()
        self.n = 0
        self.last_so = None
        sched = self.core.scheduler
        self.schedule = CallTimes(sched.schedule)
        self.update = sched.update_from_output = CallTimes(sched.update_from_output)
        self.execute = executor.execute_model = CallTimes(executor.execute_model)

        def schedule_and_keep():
            self.last_so = self.schedule()
            return self.last_so

        sched.schedule = schedule_and_keep

    def add(self, prompt_len: int, max_tokens: int) -> None:
        prompt = [self.rng.randrange(1, VOCAB) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.core.add_request(EngineCoreRequest(f"req-{self.n}", prompt, params, time.time()))
        self.n += 1

    def reset_timers(self) -> None:
        for t in (self.schedule, self.update, self.execute):
            t.clear()

    def measure(self, num_steps: int, before_step=None) -> dict:
        """Run num_steps timed steps; the SchedulerOutput of each is encoded afterwards, untimed in the step."""
        self.reset_timers()
        step, encode = CallTimes(self.core.step), CallTimes(self.codec.encode)
        sizes, tokens, prefill_reqs = [], [], []
        gc.collect()
        for _ in range(num_steps):
            if before_step is not None:
                before_step()
            step()
            so = self.last_so
            sizes.append(len(encode(so)))
            tokens.append(so.total_num_scheduled_tokens)
            prefill_reqs.append(sum(1 for n in so.num_scheduled_tokens.values() if n > 1))
        stats = self.core.get_stats()
        return {
            "steps": num_steps,
            "step": step.wall,
            "schedule": list(self.schedule.wall),
            "execute": list(self.execute.wall),
            "update": list(self.update.wall),
            "encode": encode.wall,
            "bytes": sizes,
            "tokens": tokens,
            "prefill_reqs": prefill_reqs,
            "running": stats.num_running_reqs,
            "waiting": stats.num_waiting_reqs,
            "preemptions": stats.num_preemptions,
            "usage": stats.kv_cache_usage,
        }


def decode_workload(args) -> dict:
    n_req, prompt_len = args.decode_reqs, 128
    steps = args.steps
    max_model_len = prompt_len + args.warmup + steps + 64
    blocks_per_req = -(-max_model_len // args.block_size)
    bench = Bench(args, num_blocks=n_req * blocks_per_req + 16, max_model_len=max_model_len)
    for _ in range(n_req):
        bench.add(prompt_len, max_model_len - prompt_len)
    while len(bench.core.scheduler.waiting) or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in bench.core.scheduler.running
    ):
        bench.core.step()  # prefill everything first
    for _ in range(args.warmup):
        bench.core.step()
    return bench.measure(steps)


def mixed_workload(args) -> dict:
    n_decode, steps = args.mixed_decode, args.steps
    max_model_len = 4096
    bench = Bench(args, num_blocks=args.mixed_blocks, max_model_len=max_model_len)
    for _ in range(n_decode):
        bench.add(64, max_model_len - 64)  # decoders that outlive the run
    while len(bench.core.scheduler.waiting) or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in bench.core.scheduler.running
    ):
        bench.core.step()
    rng = random.Random(args.seed + 1)

    def arrivals():  # keep two long prompts waiting, so every step has prefill work
        while len(bench.core.scheduler.waiting) < 2:
            bench.add(rng.randint(500, 2000), 16)

    for _ in range(args.warmup):
        arrivals()
        bench.core.step()
    return bench.measure(steps, arrivals)


def us(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.mean(xs) * 1e6:8.1f}"


def p(xs: list[float], q: float) -> str:
    xs = sorted(xs)
    return f"{xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6:8.1f}"


def report(name: str, r: dict) -> None:
    total = sum(r["step"])
    print(f"\n== {name}: {r['steps']} steps, {statistics.mean(r['tokens']):.0f} tokens/step, "
          f"{statistics.mean(r['prefill_reqs']):.1f} prefill chunks/step, running {r['running']}, "
          f"waiting {r['waiting']}, preemptions {r['preemptions']}, KV usage {r['usage']:.1%}")
    print(f"   {r['steps'] / total:,.0f} steps/s, {total / r['steps'] * 1e6:,.1f} us/step, "
          f"{sum(r['tokens']) / total:,.0f} scheduled tokens/s")
    print(f"   {'part':<38}{'mean us':>8}{'p50 us':>9}{'p99 us':>9}")
    rows = [
        ("EngineCore.step() total", r["step"]),
        ("  Scheduler.schedule()", r["schedule"]),
        ("  ReferenceExecutor.execute_model()", r["execute"]),
        ("  Scheduler.update_from_output()", r["update"]),
        ("msgspec encode of SchedulerOutput", r["encode"]),
    ]
    for label, xs in rows:
        print(f"   {label:<38}{us(xs)} {p(xs, 0.5)} {p(xs, 0.99)}")
    rest = [s - a - b - c for s, a, b, c in zip(r["step"], r["schedule"], r["execute"], r["update"], strict=True)]
    print(f"   {'  (rest of step(): outputs, stats)':<38}{us(rest)}")
    print(f"   SchedulerOutput size: {statistics.mean(r['bytes']):,.0f} bytes mean, {max(r['bytes']):,} max")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps (a few seconds)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per workload (default 1000, 100 with --quick)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps before timing (default 50, 10 with --quick)")
    ap.add_argument("--decode-reqs", type=int, default=256)
    ap.add_argument("--mixed-decode", type=int, default=200)
    ap.add_argument("--mixed-blocks", type=int, default=40_000)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--check-block-tables", action="store_true", help="also compute and verify digests every step")
    ap.add_argument("--only", choices=["decode", "mixed"], default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.steps is None:
        args.steps = 100 if args.quick else 1000
    if args.warmup is None:
        args.warmup = 10 if args.quick else 50
    print(f"scheduler_bench: budget {args.budget} tokens, max_num_seqs {args.max_num_seqs}, block size "
          f"{args.block_size}, prefix caching {'off' if args.no_prefix_caching else 'on'}, "
          f"check_block_tables {args.check_block_tables}, python {sys.version.split()[0]}")
    if args.only in (None, "decode"):
        print(f"decode: {args.decode_reqs} requests ...", flush=True)
        report(f"decode, {args.decode_reqs} running", decode_workload(args))
    if args.only in (None, "mixed"):
        print(f"\nmixed: {args.mixed_decode} decoding + arrivals of 500-2000-token prompts ...", flush=True)
        report(f"mixed prefill/decode, {args.mixed_decode} decoding", mixed_workload(args))


if __name__ == "__main__":
    main()
