"""/v1/responses through the official `openai` client (client.responses): stateless text and function tools,
whole and streamed in OpenAI's event shape. The answer is an output message with an output_text part; a forced
call comes back as function_call items whose arguments match the schema, and sending the call and its output back
as input items (no previous_response_id: nothing is stored) gets the answer."""

import json

import jsonschema
import openai

from tests.e2e.openai_server import start_api_server
from tests.e2e.test_openai_tools import SCHEMAS, TOOL_FLAGS

TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": SCHEMAS["get_weather"]},
         {"type": "function", "name": "book_table", "parameters": SCHEMAS["book_table"]}]
SCHEMA = {"type": "object", "required": ["ok", "n"], "additionalProperties": False,
          "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}


def test_responses_text_tools_and_stream(start_server):
    api = start_api_server(start_server, *TOOL_FLAGS, "--max-model-len", "2048", "--kv-cache-memory-bytes", "64MiB")
    client = openai.OpenAI(base_url=f"{api.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    text = client.responses.create(model=model, input="Say hello.", instructions="Be brief.", max_output_tokens=16,
                                   temperature=0)
    assert text.status in ("completed", "incomplete") and text.output[0].type == "message"
    assert text.output[0].status == text.status  # a message cut off by max_output_tokens is incomplete too
    cut = client.responses.create(model=model, input="Say hello.", max_output_tokens=2, temperature=0)
    assert cut.status == cut.output[0].status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text and cut.usage.output_tokens == 2
    assert text.output[0].content[0].type == "output_text" and text.output_text == text.output[0].content[0].text
    assert text.usage.output_tokens > 0 and text.usage.input_tokens > 0

    events = list(client.responses.create(model=model, input="Say hello.", instructions="Be brief.",
                                          max_output_tokens=16, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                        "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == text.output_text == events[-1].response.output_text  # temperature 0: the same text
    assert events[-1].response.output[0].status == events[-1].response.status == text.status

    # Forced calls get room for 1,000 tokens: sampled, the random model makes one call in about 170 tokens, and now and
    # then several (300 tokens cut off 1 of 2,200 such requests)
    forced = client.responses.create(model=model, input="Weather in Paris?", tools=TOOLS, tool_choice="required",
                                     temperature=1.0, max_output_tokens=1000)
    calls = [item for item in forced.output if item.type == "function_call"]
    assert calls and forced.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    named = client.responses.create(model=model, input="Book a table.", tools=TOOLS, max_output_tokens=300,
                                    tool_choice={"type": "function", "name": "book_table"})
    assert [item.name for item in named.output if item.type == "function_call"] == ["book_table"]

    replay = [{"role": "user", "content": "Weather in Paris?"},
              *({"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
                for c in calls),
              *({"type": "function_call_output", "call_id": c.call_id, "output": "21 C"} for c in calls)]
    answer = client.responses.create(model=model, input=replay, max_output_tokens=16, temperature=0)
    assert answer.output[0].type == "message" and isinstance(answer.output_text, str)

    stream = list(client.responses.create(model=model, input="Weather?", tools=TOOLS, tool_choice="required",
                                          max_output_tokens=1000, stream=True))
    done = [e.item for e in stream if e.type == "response.output_item.done"]
    assert done and all(item.type == "function_call" for item in done)
    assert stream[-1].response.output == done

    structured = client.responses.create(model=model, input="Report.", max_output_tokens=100, text={
        "format": {"type": "json_schema", "name": "report", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(structured.output_text), SCHEMA)

    for body, param in (({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
                        ({"tools": [{"type": "web_search"}]}, "tools"),
                        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
                         "text"),
                        ({"max_output_tokens": 5000}, "max_output_tokens")):
        status, error = api.request("POST", "/v1/responses", {"input": "hi", **body})
        assert status == 400 and error["error"]["param"] == param, (body, error)
