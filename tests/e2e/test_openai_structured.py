"""Structured outputs over the HTTP API, through the official `openai` client: OpenAI's response_format
(json_object, json_schema, and the SDK's parse with a pydantic model), vLLM's structured_outputs and its older
guided_* fields. With the built-in random-weight model the grammar alone makes every output valid; with SmolLM2 a
real model writes under it. 100 generations at temperature 1 of each kind, sent at once; an invalid schema or
regex is a 400 naming its field."""

import asyncio
import json
import re
from typing import Annotated, Literal

import jsonschema
import openai
import pydantic

from tests.e2e.openai_server import start_api_server
from tests.launch.text_support import smollm2_path

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "name": {"type": "string", "maxLength": 12},
        "owner": {"type": "object", "additionalProperties": False, "required": ["age", "tags"],
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}},
    },
    "required": ["id", "kind", "name", "owner"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
REGEX = r"[A-Z][a-z]{1,8} [0-9]{1,3}"
CHOICES = ["Paris", "London", "New York"]
QUESTION = [{"role": "user", "content": "Describe a pet as JSON."}]


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: Literal["cat", "dog"]
    age: int = pydantic.Field(ge=0, le=30)
    toys: list[Annotated[str, pydantic.Field(max_length=6)]] = pydantic.Field(max_length=2)


async def hundred(client: openai.AsyncOpenAI, model: str, **kwargs) -> list[tuple[str, str]]:
    """100 chat completions at temperature 1 (seeds 0-99), sent at once: (content, finish_reason) of each."""
    async def one(seed: int):
        answer = await client.chat.completions.create(model=model, messages=QUESTION, temperature=1.0, seed=seed,
                                                      max_tokens=300, **kwargs)
        return answer.choices[0].message.content, answer.choices[0].finish_reason
    return await asyncio.gather(*(one(seed) for seed in range(100)))


def check_hundred(client: openai.AsyncOpenAI, model: str) -> None:
    async def run():
        return await asyncio.gather(
            hundred(client, model, response_format=JSON_SCHEMA),
            hundred(client, model, extra_body={"guided_regex": REGEX}),
            hundred(client, model, extra_body={"guided_choice": CHOICES}),
            hundred(client, model, extra_body={"structured_outputs": {"choice": CHOICES}}))
    schema_outs, regex_outs, choice_outs, vllm_choice_outs = asyncio.run(run())
    for text, finish in schema_outs:
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
    assert all(re.fullmatch(REGEX, text) and finish == "stop" for text, finish in regex_outs)
    assert all(text in CHOICES and finish == "stop" for text, finish in choice_outs + vllm_choice_outs)
    assert len({text for text, _ in schema_outs}) > 1  # sampled


def check_parse(client: openai.OpenAI, model: str) -> None:
    parsed = client.beta.chat.completions.parse(model=model, messages=QUESTION, response_format=Pet, temperature=1.0,
                                                seed=3, max_tokens=300)
    pet = parsed.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog") and 0 <= pet.age <= 30


def test_builtin_model_structured_outputs(start_server):
    api = start_api_server(start_server, "--max-model-len", "512", "--kv-cache-memory-bytes", "64MiB")
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)
    async_client = openai.AsyncOpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    check_hundred(async_client, model)
    check_parse(client, model)

    obj = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=300, seed=1,
                                         response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason in ("stop", "length")  # any object: a random model may ramble in a key
    streamed = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=300, seed=2, stream=True,
                                              response_format=JSON_SCHEMA)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in streamed if c.choices)), SCHEMA)
    completion = client.completions.create(model=model, prompt="The answer:", max_tokens=40, seed=4,
                                           extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, completion.choices[0].text)
    grammar = client.completions.create(model=model, prompt="Count:", max_tokens=40, seed=5,
                                        extra_body={"guided_grammar": 'start: "one" (", " ("two" | "three"))*'})
    assert re.fullmatch(r"one(, (two|three))*", grammar.choices[0].text)


INVALID = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{not json"}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"guided_json": {"type": "string", "pattern": "("}}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
]


def test_an_invalid_structured_output_is_a_400_naming_its_field(start_server):
    api = start_api_server(start_server, "--max-model-len", "256", "--kv-cache-memory-bytes", "8MiB")
    for body, param in INVALID:
        for path, prompt in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "x"})):
            status, answer = api.request("POST", path, {**prompt, "max_tokens": 4, **body})
            assert status == 400 and answer["error"]["param"] == param, (body, answer)
    assert api.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4})[0] == 200


def test_smollm2_structured_outputs(start_server):
    api = start_api_server(start_server, "--model", str(smollm2_path()), "--served-model-name", "smollm2",
                           "--max-model-len", "1024", "--kv-cache-memory-bytes", "256MiB")
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)
    check_hundred(openai.AsyncOpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0), "smollm2")
    check_parse(client, "smollm2")
