"""Tool calling over the HTTP API with the official `openai` client (--enable-auto-tool-choice --tool-call-parser
hermes): forced calls (a named function, and required) parse and match the function's parameter schema 100 times
out of 100 at temperature 1, with the built-in random-weight model and with SmolLM2; streamed calls arrive as
OpenAI's tool_calls deltas; a full agent turn (call, tool result, answer) replays the assistant's tool-call turn
and the tool message through the chat template, also without tools in the request."""

import asyncio
import json

import jsonschema
import openai

from tests.e2e.openai_server import start_api_server
from tests.launch.text_support import smollm2_path

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a restaurant table",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["people"],
                   "properties": {"people": {"type": "integer", "minimum": 1, "maximum": 12},
                                  "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}}}}
TOOLS = [WEATHER, BOOK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def hundred_forced(base_url: str, model: str) -> None:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}

    async def one(seed: int, choice):
        answer = await client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=choice,
                                                      temperature=1.0, seed=seed, max_tokens=400)
        return answer.choices[0]

    async def run():
        return await asyncio.gather(*(one(s, named) for s in range(100)), *(one(s, "required") for s in range(100)))

    results = asyncio.run(run())
    for choice in results[:100]:
        assert choice.finish_reason == "stop" and choice.message.content is None
        check_calls(choice.message.tool_calls, ("get_weather",))
        assert len(choice.message.tool_calls) == 1
    for choice in results[100:]:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        check_calls(choice.message.tool_calls)


def agent_turn(client: openai.OpenAI, model: str) -> str:
    """Call, tool result, answer; the answer's request replays the call without tools."""
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0.7, seed=1, max_tokens=300)
    calls = first.choices[0].message.tool_calls
    check_calls(calls)
    turn = first.choices[0].message.model_dump(exclude_none=True)
    results = [{"role": "tool", "tool_call_id": c.id, "content": json.dumps({"temperature": 21})} for c in calls]
    second = client.chat.completions.create(model=model, messages=[*ASK, turn, *results], temperature=0,
                                            max_tokens=24)
    assert isinstance(second.choices[0].message.content, str) and second.choices[0].message.tool_calls is None
    with_tools = client.chat.completions.create(model=model, messages=[*ASK, turn, *results], tools=TOOLS,
                                                tool_choice="none", temperature=0, max_tokens=24)
    assert with_tools.choices[0].message.tool_calls is None
    return second.choices[0].message.content


def test_builtin_model_tool_calls(start_server):
    api = start_api_server(start_server, *TOOL_FLAGS, "--max-model-len", "1024", "--kv-cache-memory-bytes", "64MiB")
    base_url = f"{api.base_url}/v1"
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    hundred_forced(base_url, model)
    agent_turn(client, model)

    stream = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=5, max_tokens=300, stream=True)
    chunks = [c for c in stream if c.choices]
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not c.choices[0].delta.content for c in chunks)
    for delta in deltas:  # whole calls, one delta each: index, id, type, name, arguments
        assert delta.id and delta.type == "function"
        jsonschema.validate(json.loads(delta.function.arguments), SCHEMAS[delta.function.name])
    assert [d.index for d in deltas] == list(range(len(deltas)))

    auto = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, temperature=1.0, seed=2,
                                          max_tokens=20)
    assert auto.choices[0].finish_reason in ("stop", "length")  # a random model seldom writes a call: text comes back
    status, body = api.request("POST", "/v1/chat/completions", {
        "messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    status, body = api.request("POST", "/v1/chat/completions", {
        "messages": ASK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
        "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "tools"


def test_auto_tool_choice_needs_the_server_flags(start_server):
    api = start_api_server(start_server, "--max-model-len", "512", "--kv-cache-memory-bytes", "8MiB")
    status, body = api.request("POST", "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "tool_choice" and "--enable-auto-tool-choice" in \
        body["error"]["message"]
    forced = api.request("POST", "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 300,
                                                          "tool_choice": "required", "seed": 3})
    assert forced[0] == 200 and forced[1]["choices"][0]["message"]["tool_calls"]  # forced calls need no parser
    name = TOOLS[0]["function"]["name"]
    cut = api.request("POST", "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "max_tokens": 3,
                                                      "tool_choice": {"type": "function", "function": {"name": name}}})
    choice = cut[1]["choices"][0]  # cut off by max_tokens: the unfinished JSON as content, no call
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")
    assert not choice["message"].get("tool_calls")


def test_smollm2_tool_calls(start_server):
    api = start_api_server(start_server, "--model", str(smollm2_path()), "--served-model-name", "smollm2",
                           *TOOL_FLAGS, "--max-model-len", "1024", "--kv-cache-memory-bytes", "256MiB")
    base_url = f"{api.base_url}/v1"
    hundred_forced(base_url, "smollm2")
    answer = agent_turn(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0), "smollm2")
    assert answer.strip()
