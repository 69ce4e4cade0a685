"""A chat request's tools and tool_choice, checked, and what they ask of the engine and of the answer.

- none: the tools still reach the chat template (as vLLM does); the output is text.
- auto (the default when tools are given): the model may call tools; its output is parsed with the server's
  --tool-call-parser, which needs --enable-auto-tool-choice (400 otherwise, as vLLM).
- required, or a named function: forced by a grammar, as vLLM forces them: the output is a JSON array of
  {"name", "parameters"} (required: one or more calls of the given tools) or the named function's arguments
  (named), each matching the function's parameter schema, so the call always parses and validates.
A forced array holds at most MAX_CALLS calls (a small model otherwise repeats calls until max_tokens);
parallel_tool_calls false keeps it to one call, and an auto answer to its first call.
"""

import json
from dataclasses import dataclass

from launch.api_server.errors import ApiError
from protocol import StructuredOutputsParams
from protocol.config import ServerConfig

MAX_CALLS = 8
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none, auto, required, named
    tools: list[dict]  # as the request gave them: the chat template gets them so
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str | None = None  # auto: the --tool-call-parser

    def forced_output(self) -> StructuredOutputsParams | None:
        """required and named: the JSON their output must be; None otherwise."""
        if self.mode == "named":
            return StructuredOutputsParams(json=json.dumps(parameters(self.function(self.name))))
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, "parameters": parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for f in (t["function"] for t in self.tools)]
        array = {"type": "array", "minItems": 1, "maxItems": MAX_CALLS if self.parallel else 1,
                 "items": {"anyOf": calls}}
        return StructuredOutputsParams(json=json.dumps(array))

    def function(self, name: str | None) -> dict:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def parameters(function: dict) -> dict:
    return function.get("parameters") or NO_PARAMETERS


def tool_choice(tools: list | None, choice: object, parallel: bool | None,
                config: ServerConfig) -> ToolChoice | None:
    """The request's tool choice, checked (400 naming tools or tool_choice); None when it has neither."""
    if tools is None and choice in (None, "none"):
        return None
    checked = check_tools(tools or [])
    mode, name = _mode(choice, checked)
    if mode == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise ApiError(400, '"auto" tool choice needs a server started with --enable-auto-tool-choice and '
                            "--tool-call-parser", "tool_choice")
    return ToolChoice(mode, checked, name, parallel is not False, config.tool_call_parser)


def _mode(choice: object, tools: list[dict]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise ApiError(400, f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice, None  # type: ignore[return-value]
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, 'tool_choice is "none", "auto", "required" or {"type": "function", "function": '
                            '{"name": ...}}', "tool_choice")
    if all(t["function"]["name"] != name for t in tools):
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
    return "named", name


def check_tools(tools: list) -> list[dict]:
    """OpenAI's tools: [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]."""
    if not isinstance(tools, list):
        raise ApiError(400, "tools is a list of functions", "tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ApiError(400, f'tools[{i}] is {{"type": "function", "function": {{"name": ..., ...}}}}', "tools")
        if not isinstance(function.get("parameters", {}), dict | None):
            raise ApiError(400, f"tools[{i}].function.parameters is a JSON schema object", "tools")
        if function["name"] in names:
            raise ApiError(400, f"tools name {function['name']!r} twice", "tools")
        names.add(function["name"])
    return tools
