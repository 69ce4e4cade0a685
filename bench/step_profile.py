"""Where a worker step's time goes on a real-size model: the share of each part (linear matmuls, LM head, sampler,
attention, norms, rotary, silu * up, the rest) in decode steps at a batch and in the prefill of a step's prompts.

    python -m bench.step_profile --model DIR [--threads 2] [--batch 64 --decode-context 256] [--prompt-len 512]
                                 [--prefill-prompts 4]

It drives one Worker in this process (tests/worker/harness.py's Driver, no engine core) under torch.profiler, the
C++ extension's functions, the LM head and the sampler wrapped in labelled ranges. Shares are of the profiled
steps' wall time; the parts are the ranges' inclusive times, matmuls outside the LM head counted as linear.
"""

import argparse
import functools
import random
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.timing import CallTimes
from protocol import SamplingParams
from protocol.config import engine_config

LINEAR_WORDS = ("linear", "mm", "matmul", "gemm", "onednn", "mkldnn")  # the op names of any linear kernel


def labelled(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        with record_function(name):
            return fn(*args, **kwargs)
    return call


def label_parts(worker) -> None:
    """Wrap the extension's functions, the LM head and the sampler (in this process only)."""
    import worker.model_runner as runner_module
    from worker.ops.cpu_attention import load_extension

    try:
        ops = load_extension()
        for name in ("paged_attention", "reshape_and_cache", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul"):
            setattr(ops, name, labelled(f"part:{name}", getattr(ops, name)))
    except Exception as e:  # noqa: BLE001 -- without the extension the torch paths show as aten ops
        print(f"no CPU extension: {e}", file=sys.stderr)
    model = worker.runner.model
    model.logits = labelled("part:lm_head", model.logits)
    runner_module.sample = labelled("part:sampler", runner_module.sample)


def shares(prof, wall: float) -> dict[str, float]:
    """Inclusive ms of each labelled part and of the linear ops outside them, from the profile's top-level events."""
    out: dict[str, float] = defaultdict(float)

    def visit(event, inside: str | None) -> None:
        name = event.name
        if name.startswith("part:"):
            out[name[5:]] += event.cpu_time_total / 1e3
            inside = name
        elif inside is None and any(word in name for word in LINEAR_WORDS):
            out["linear"] += event.cpu_time_total / 1e3
            return
        for child in event.cpu_children:
            visit(child, inside)

    for event in prof.events():
        if event.cpu_parent is None:
            visit(event, None)
    out["other"] = wall * 1e3 - sum(out.values())
    return dict(out)


def unlabelled_top(prof, n: int = 6) -> str:
    """The ops that took the most self time outside the labelled parts and the linear ops."""
    rows = [e for e in prof.key_averages() if not e.key.startswith("part:")
            and not any(word in e.key for word in LINEAR_WORDS)]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    return ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.1f} ms" for e in rows[:n])


def profiled_run(folder: str, threads: int, batch: int, prompt_len: int, prefill_prompts: int, decode_context: int,
                 steps: int, params: SamplingParams) -> None:
    from tests.worker.harness import Driver, Req, kv_config
    from worker.cpu_malloc import keep_freed_memory
    from worker.worker import Worker

    torch.set_num_threads(threads)
    model_len = max(prompt_len, decode_context) + 2 * steps + 16
    config = engine_config(model=folder, max_model_len=model_len, max_num_seqs=batch + prefill_prompts,
                           max_num_batched_tokens=max(batch * decode_context, prefill_prompts * prompt_len),
                           kv_cache_memory_bytes=[2 << 30])
    w = Worker(config)
    keep_freed_memory()  # after the load, as a served CPU worker does
    cfg = kv_config(w, (batch + prefill_prompts + 1) * -(-model_len // 16) + 1)
    w.init_kv_cache(cfg)
    for cache in w.runner.kv.kv_tensors:  # its pages are zeroed on first write (worker/memory.py): not a step's cost
        if isinstance(cache, torch.Tensor):
            cache.fill_(0)
    label_parts(w)
    rng = random.Random(2)

    def prompts(n: int, length: int = prompt_len) -> list[list[int]]:
        return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(n)]

    driver = Driver(w, cfg, prefix_caching=False)
    driver.run(prompts(1), 2)  # warm-up: the kernels built per shape
    timed = w.execute_model = CallTimes(w.execute_model)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        driver.step_once([Req(f"prefill{i}", p, 1, params) for i, p in enumerate(prompts(prefill_prompts))], [])
    report(f"prefill of {prefill_prompts} x {prompt_len}-token prompts in one step", prof, sum(timed.wall))
    reqs = [Req(f"d{i}", p, steps + 1, params) for i, p in enumerate(prompts(batch, decode_context))]
    driver.step_once(reqs, [])  # their prefill, unprofiled
    timed.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            driver.step_once(reqs, [])
    report(f"{steps} decode steps at batch {batch}, contexts {decode_context}-{decode_context + steps}", prof,
           sum(timed.wall))


def report(title: str, prof, wall: float) -> None:
    parts = shares(prof, wall)
    print(f"\n{title}: {wall * 1e3:.1f} ms")
    for name, ms in sorted(parts.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<18} {ms:>9.1f} ms  {100 * ms / (wall * 1e3):5.1f}%")
    print(f"  (most self time otherwise: {unlabelled_top(prof)})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF folder or GGUF file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prefill-prompts", type=int, default=1, help="prompts of the profiled prefill step")
    p.add_argument("--decode-context", type=int, default=256, help="prompt tokens of the decoding requests")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.0, help="of every request (0: greedy)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    args = p.parse_args()
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, max_tokens=1 << 20,
                            ignore_eos=True)
    profiled_run(args.model, args.threads, args.batch, args.prompt_len, args.prefill_prompts, args.decode_context,
                 args.steps, params)
    return 0


if __name__ == "__main__":
    sys.exit(main())
