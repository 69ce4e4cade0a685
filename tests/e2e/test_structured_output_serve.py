"""Structured outputs through `kvengine serve`'s processes: the engine core sends each step's bitmask to rank 0
over the worker socket (after the step, and with async scheduling once the step before it is applied), with
tensor parallelism and behind the data-parallel router. Seeded sampling at temperature 1 gives exactly the tokens
of the in-process engine, which are valid; a grammar that cannot compile fails its own request only."""

import asyncio
import json

import jsonschema
import pytest

from engine_core.core import EngineCore
from launch.client import AsyncEngineClient
from protocol import EngineCoreRequest, SamplingParams, StructuredOutputsParams
from protocol.config import engine_config
from protocol.model.builtin_tokenizer import builtin_tokenizer
from tests.e2e.serve_support import FP32, SMALL, collect, prompts
from worker.inproc_executor import InProcExecutor

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "kind": {"enum": ["a", "b"]},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2}},
    "required": ["id", "kind", "tags"],
    "additionalProperties": False,
}
SPEC = StructuredOutputsParams(json=json.dumps(SCHEMA))


def params(i: int) -> SamplingParams:
    constrained = i % 3 != 2
    return SamplingParams(temperature=1.0, seed=i, max_tokens=300 if constrained else 24, ignore_eos=not constrained,
                          structured_outputs=SPEC if constrained else None)


BATCH = prompts(12, seed=7)


@pytest.fixture(scope="module")
def in_process() -> list[list[int]]:
    """Each request's tokens from the engine in this process (SMALL's settings, float32)."""
    config = engine_config(dtype="float32", max_model_len=512, kv_cache_memory_bytes=[8 << 20])
    core = EngineCore(config, InProcExecutor(config))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(BATCH))}
    try:
        for i, prompt in enumerate(BATCH):
            core.add_request(EngineCoreRequest(str(i), prompt, params(i), 0.0))
        while core.has_work():
            for out in core.step().outputs:
                tokens[out.request_id] += out.new_token_ids
    finally:
        core.shutdown()
    return [tokens[str(i)] for i in range(len(BATCH))]


@pytest.mark.parametrize("flags", [("-tp", "2"), ("-tp", "2", "--async-scheduling"),
                                   ("-dp", "2", "--async-scheduling")], ids=["tp2", "tp2-async", "dp2-async"])
def test_constrained_and_plain_requests_match_the_in_process_engine(start_server, flags, in_process):
    server = start_server(*flags, *FP32, *SMALL)
    asyncio.run(server.wait_ready())

    async def run_all():
        async with AsyncEngineClient(server.address) as client:
            bad = collect(client, BATCH[0], SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")))
            return await asyncio.gather(bad, *(collect(client, p, params(i)) for i, p in enumerate(BATCH)))

    (bad_tokens, bad_last), *results = asyncio.run(run_all())
    assert bad_tokens == [] and bad_last.finish_reason == "error" and "structured_outputs.regex" in bad_last.error
    text = builtin_tokenizer()
    for i, ((tokens, last), expected) in enumerate(zip(results, in_process, strict=True)):
        assert tokens == expected
        if params(i).structured_outputs is not None:
            assert last.finish_reason == "stop"
            jsonschema.validate(json.loads(text.decode(tokens, skip_special_tokens=True)), SCHEMA)
