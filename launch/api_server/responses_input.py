"""OpenAI's Responses API request, stateless: `input` (a text, or message, function_call and function_call_output
items) with `instructions`, function tools, tool_choice and text.format, turned into the chat request that
/v1/chat/completions serves. Nothing is stored, so `previous_response_id` and `store: true` are refused by name."""

import msgspec

from launch.api_server.errors import ApiError
from launch.api_server.schemas import ChatCompletionRequest

TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: dict | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    stream: bool = False
    metadata: dict[str, str] | None = None  # returned with the response
    previous_response_id: str | None = None  # refused: nothing is stored
    store: bool | None = None  # true refused: nothing is stored


def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that answers req (400 naming the field for what it cannot hold)."""
    if req.previous_response_id is not None:
        raise ApiError(400, "previous_response_id is not supported: responses are not stored; send the conversation "
                            "in input", "previous_response_id")
    if req.store:
        raise ApiError(400, "store is not supported: responses are not stored", "store")
    messages = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
    body: dict = {"messages": messages + input_messages(req.input), "max_tokens": req.max_output_tokens}
    body |= {k: v for k, v in (("temperature", req.temperature), ("top_p", req.top_p)) if v is not None}
    if req.tools is not None:
        body["tools"] = [chat_tool(i, tool) for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = chat_tool_choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.text is not None:
        body["response_format"] = response_format(req.text)
    try:
        return msgspec.convert(body, ChatCompletionRequest)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}") from None


def input_messages(value: str | list[dict]) -> list[dict]:
    """input as chat messages: a text is the user's; items are messages (developer as system), function calls
    (joined into one assistant turn with tool_calls) and their outputs (tool messages)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict] = []
    for i, item in enumerate(value):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f"input[{i}].role is user, system, developer or assistant", "input")
            messages.append({"role": "system" if role == "developer" else role, "content": text_of(item, i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:
            raise ApiError(400, f"input[{i}] of type {kind!r} is not supported: message, function_call or "
                                "function_call_output", "input")
    return messages


def text_of(item: dict, i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"input[{i}].content is a text or a list of text parts", "input")


def chat_tool(i: int, tool: dict) -> dict:
    """A Responses function tool ({"type": "function", "name", "parameters", ...}) in the chat API's shape."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ApiError(400, f"tools[{i}]: only function tools are supported", "tools")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict) -> dict:
    """text.format as the chat API's response_format."""
    spec = text.get("format") if isinstance(text, dict) else None
    if not isinstance(spec, dict):
        raise ApiError(400, 'text is {"format": {"type": ...}}', "text")
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: spec[k] for k in ("name", "schema", "strict", "description")
                                                       if k in spec}}
    return spec
