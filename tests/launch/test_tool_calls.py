"""Tool-call parsing on recorded model outputs, whole and streamed: Hermes-style <tool_call> (Qwen2.5, Qwen3),
Llama 3 JSON and Mistral [TOOL_CALLS], with text before a call, two calls in one turn, and malformed calls
(returned as text). Forced choices (required, named) parse vLLM's JSON forms. Streamed in pieces of every size,
the content and calls put back together equal the whole answer's."""

import json

import pytest

from launch.api_server.errors import ApiError
from launch.api_server.tools.answer import ToolAnswer
from launch.api_server.tools.choice import tool_choice
from launch.api_server.tools.messages import template_messages
from launch.api_server.tools.parsers import PARSERS
from protocol.config import ServerConfig

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
PARIS = ("get_weather", {"city": "Paris"})
TOKYO = ("get_weather", {"city": "Tokyo"})
NOW = ("get_time", {})

# (parser, recorded output, content, calls); calls None: no well-formed call, the whole output is content
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None, [PARIS]),
    ("hermes", ('Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
               "</tool_call>"), "Let me look that up.\n", [PARIS]),
    ("hermes", ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {}}\n</tool_call>'), None, [PARIS, NOW]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>', None,
     [PARIS]),  # arguments written as a JSON string
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>', None, None),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, None),  # cut short
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>', None, None),  # no name
    ("hermes", "<tool_call>\n{}\n</tool_call> and then some text", None, None),
    ("hermes", "The capital of France is Paris.", None, None),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", ('{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_weather", '
                    '"parameters": {"city": "Tokyo"}}'), None, [PARIS, TOKYO]),
    ("llama3_json", 'I will call a tool.\n{"name": "get_time", "parameters": {}}', "I will call a tool.\n", [NOW]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": }', None, None),
    ("llama3_json", "Use {braces} like this: {x}.", None, None),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [PARIS]),
    ("mistral", ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", '
                '"arguments": {"city": "Tokyo"}}]'), None, [PARIS, TOKYO]),
    ("mistral", 'Checking. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Checking. ", [NOW]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}', None, [PARIS, NOW]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}', None, None),
    ("mistral", "[TOOL_CALLS]get_weather{}", None, None),
]


def auto(parser: str, parallel: bool = True):
    return tool_choice([WEATHER, TIME], None, parallel, ServerConfig(enable_auto_tool_choice=True,
                                                                     tool_call_parser=parser))


def as_pairs(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def streamed(answer: ToolAnswer, text: str, size: int) -> tuple[str, list[dict], str]:
    """The text in pieces of size characters, the last with finish_reason stop: (content put together,
    tool_calls deltas, finish_reason)."""
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    deltas = [answer.delta(piece, "stop" if i == len(pieces) - 1 else None) for i, piece in enumerate(pieces)]
    content = "".join(d.get("content", "") for d, _ in deltas)
    calls = [c for d, _ in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert all(f is None for _, f in deltas[:-1])
    return content, calls, deltas[-1][1]


@pytest.mark.parametrize("parser,text,content,calls", RECORDED, ids=[f"{p}-{i}" for i, (p, *_) in enumerate(RECORDED)])
def test_recorded_outputs_whole_and_streamed(parser, text, content, calls):
    message, finish = ToolAnswer(auto(parser)).message(text, "stop")
    if calls is None:
        assert message == {"role": "assistant", "content": text} and finish == "stop"
    else:
        assert message["content"] == content and as_pairs(message["tool_calls"]) == calls
        assert finish == "tool_calls" and all(c["id"] and c["type"] == "function" for c in message["tool_calls"])
    for size in (1, 2, 3, 7, len(text)):
        got_content, got_calls, got_finish = streamed(ToolAnswer(auto(parser)), text, size)
        assert got_content == (text if calls is None else content or "")
        assert as_pairs(got_calls) == (calls or []) and got_finish == finish


def test_mistral_ids_are_nine_letters_and_digits():
    message, _ = ToolAnswer(auto("mistral")).message(RECORDED[16][1], "stop")
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in message["tool_calls"])


def test_a_trailing_end_of_sequence_text_is_not_part_of_the_call():
    answer = ToolAnswer(auto("mistral"), end_texts=("</s>",))
    message, _ = answer.message('[TOOL_CALLS][{"name": "get_time", "arguments": {}}]</s>', "stop")
    assert as_pairs(message["tool_calls"]) == [NOW]


def test_parallel_tool_calls_false_keeps_the_first_call():
    message, _ = ToolAnswer(auto("hermes", parallel=False)).message(RECORDED[2][1], "stop")
    assert as_pairs(message["tool_calls"]) == [PARIS]


def test_forced_choices_parse_vllms_json_forms():
    config = ServerConfig()
    named = tool_choice([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, config)
    assert json.loads(named.forced_output().json) == WEATHER["function"]["parameters"]
    message, finish = ToolAnswer(named).message('{"city": "Paris"}', "stop")
    assert message["content"] is None and as_pairs(message["tool_calls"]) == [PARIS] and finish == "stop"
    required = tool_choice([WEATHER, TIME], "required", False, config)
    schema = json.loads(required.forced_output().json)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    message, finish = ToolAnswer(required).message(text, "stop")
    assert as_pairs(message["tool_calls"]) == [PARIS] and finish == "tool_calls"
    content, calls, _ = streamed(ToolAnswer(required), text, 4)
    assert content == "" and as_pairs(calls) == [PARIS]
    cut = ToolAnswer(required).message(text[:20], "length")  # max_tokens cut the call: text, as it is
    assert cut == ({"role": "assistant", "content": text[:20]}, "length")


@pytest.mark.parametrize("tools,choice,param", [
    ([WEATHER], None, "tool_choice"),  # auto without --enable-auto-tool-choice
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    ([{"type": "function"}], "required", "tools"),
    ([WEATHER, WEATHER], "required", "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required", "tools"),
])
def test_bad_tools_and_choices_are_400s_naming_the_field(tools, choice, param):
    with pytest.raises(ApiError) as error:
        tool_choice(tools, choice, None, ServerConfig())
    assert error.value.status == 400 and error.value.param == param


def test_none_and_no_tools():
    assert tool_choice(None, None, None, ServerConfig()) is None
    none = tool_choice([WEATHER], "none", None, ServerConfig())
    assert none.forced_output() is None and ToolAnswer(none).message("<tool_call>", "stop")[0]["content"] == "<tool_call>"


def test_replayed_arguments_reach_the_template_as_objects():
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "not json"}}]}
    out = template_messages([turn, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert turn["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the request's own is untouched


def test_the_config_names_every_parser():
    import typing

    from protocol.config import ServerConfig as Config

    hint = typing.get_type_hints(Config, include_extras=True)["tool_call_parser"]
    literal = next(a for a in typing.get_args(typing.get_args(hint)[0]) if typing.get_origin(a) is typing.Literal)
    assert set(typing.get_args(literal)) == set(PARSERS)
