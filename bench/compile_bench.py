"""What torch.compile of the decoder layers gains over the fused CPU kernels the model uses by default.

    python -m bench.compile_bench [--threads 2] [--dtype bfloat16]

Three in-process engines (EngineCore + InProcExecutor, built-in model, attention by the CPU kernel),
each timed on 64 x 512-token prompts: prefill (one output token), then a 128-token decode:
- fused: the default, norms / rotary / silu * up as the extension's fused kernels;
- torch: the same layers as plain torch ops (the reference path);
- compiled: the torch ops under torch.compile(dynamic=True) (the attention kernel is a graph break).
Each engine is warmed up on a batch of the same shape first; the compile time is printed apart.
"""

import argparse
import random
import time

import torch

from bench.timing import stopwatch
from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from worker.inproc_executor import InProcExecutor


def plain_torch_layers(model) -> None:
    """Switch the model's norms, rotary and silu * up from the fused kernels to torch ops."""
    model.rotary.ops = model.norm.ops = None
    for layer in model.layers:
        layer.ops = layer.input_norm.ops = layer.post_norm.ops = None


def run_batch(core: EngineCore, prompts: list[list[int]], max_tokens: int, tag: str) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"{tag}-{i}", prompt, params, time.time()))
    with stopwatch() as lap:
        while core.has_work():
            core.step()
    return lap.wall


def measure(kind: str, args, rng: random.Random) -> None:
    config = engine_config(max_model_len=1024, max_num_seqs=args.num_prompts, dtype=args.dtype,
                           kv_cache_memory_bytes=[1 << 30], enable_prefix_caching=False)
    executor = InProcExecutor(config)
    model = executor.worker.model
    if kind != "fused":
        plain_torch_layers(model)
    core = EngineCore(config, executor)
    if kind == "compiled":
        model.layers = [torch.compile(layer, dynamic=True) for layer in model.layers]

    def prompts() -> list[list[int]]:
        return [[rng.randrange(3, 1000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]

    warmup = run_batch(core, prompts(), 16, "warmup")
    prefill = run_batch(core, prompts(), 1, "prefill")
    total = run_batch(core, prompts(), args.output_len, "decode")
    print(f"{kind:<9} warm-up {warmup:6.1f} s   prefill {prefill:5.2f} s   "
          f"{args.num_prompts} x {args.output_len} tokens {total:5.2f} s   "
          f"output tok/s {args.num_prompts * args.output_len / total:7,.0f}", flush=True)
    core.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    for kind in ("fused", "torch", "compiled"):
        measure(kind, args, rng)


if __name__ == "__main__":
    main()
