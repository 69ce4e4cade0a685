"""Structured outputs with a real model: the built-in random-weight model (its grammar alone must make the output
valid) through the real EngineCore and InProcExecutor, float32. The worker masks each constrained row with the
engine core's bitmask before sampling; an unconstrained request beside them, preempted or not, gets exactly the
tokens it gets alone."""

import json
import re

import jsonschema
import pytest

from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams, StructuredOutputsParams
from protocol.config import engine_config
from protocol.model.builtin_tokenizer import builtin_tokenizer
from worker.inproc_executor import InProcExecutor

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 8},
        "owner": {"type": "object", "additionalProperties": False, "required": ["age", "tags"],
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "tags": {"type": "array", "maxItems": 3,
                                          "items": {"enum": ["a", "b", "c"]}}}},
    },
    "required": ["id", "kind", "owner"],
    "additionalProperties": False,
}
REGEX = r"(\+|-)?[0-9]{1,4}(\.[0-9]{1,2})? (kg|lb)"
CHOICES = ["yes", "no", "maybe not"]
TEXT = builtin_tokenizer()


def engine(async_scheduling: bool = False, **overrides) -> EngineCore:
    settings = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 128, "max_num_batched_tokens": 2048,
                "kv_cache_memory_bytes": [16 << 20], "async_scheduling": async_scheduling} | overrides
    config = engine_config(**settings)
    return EngineCore(config, InProcExecutor(config))


def generate(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    for rid, (prompt, params) in requests.items():
        core.add_request(EngineCoreRequest(rid, prompt, params, 0.0))
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    finish: dict[str, str] = {}
    while core.has_work():
        for out in core.step().outputs:
            assert out.error is None, (out.request_id, out.error)
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                finish[out.request_id] = out.finish_reason
    return {rid: (tokens[rid], finish[rid]) for rid in requests}


def constrained(spec: StructuredOutputsParams, seed: int, max_tokens: int = 400) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec)


def prompt(i: int) -> list[int]:
    return [1, *(3 + (i * 37 + k * 11) % 250 for k in range(5 + i % 7))]


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_one_hundred_random_model_generations_all_match(kind):
    spec = {"json": StructuredOutputsParams(json=json.dumps(SCHEMA)), "regex": StructuredOutputsParams(regex=REGEX),
            "choice": StructuredOutputsParams(choice=CHOICES)}[kind]
    core = engine()
    try:
        results = generate(core, {str(i): (prompt(i), constrained(spec, i)) for i in range(100)})
    finally:
        core.shutdown()
    texts = []
    for tokens, finish in results.values():
        assert finish == "stop"
        text = TEXT.decode(tokens, skip_special_tokens=True)
        texts.append(text)
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES
    assert len(set(texts)) > (2 if kind == "choice" else 50)  # sampled, not one walk repeated


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_unconstrained_requests_get_their_solo_tokens_beside_constrained_ones(async_scheduling):
    """A pool small enough to preempt and a budget that prefills in chunks; seeded sampling at temperature 1."""
    plain = {f"p{i}": (prompt(i) * 4, SamplingParams(temperature=1.0, seed=100 + i, max_tokens=48, ignore_eos=True))
             for i in range(6)}
    solo = {}
    for rid, request in plain.items():
        core = engine(async_scheduling)
        try:
            solo.update(generate(core, {rid: request}))
        finally:
            core.shutdown()
    spec = StructuredOutputsParams(json=json.dumps(SCHEMA))
    mixed = {**plain, **{f"c{i}": (prompt(50 + i) * 3, constrained(spec, i, 250)) for i in range(6)}}
    core = engine(async_scheduling, max_model_len=300, num_gpu_blocks_override=20, max_num_batched_tokens=64,
                  long_prefill_token_threshold=32)
    try:
        results = generate(core, dict(sorted(mixed.items(), key=lambda kv: kv[0][1:])))  # interleaved
        assert core.get_stats().num_preemptions > 0
    finally:
        core.shutdown()
    for rid in plain:
        assert results[rid] == solo[rid], rid
    for i in range(6):
        tokens, finish = results[f"c{i}"]
        assert finish == "stop"
        jsonschema.validate(json.loads(TEXT.decode(tokens, skip_special_tokens=True)), SCHEMA)
