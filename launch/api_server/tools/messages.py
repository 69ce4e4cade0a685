"""A conversation with tool calls as chat templates read it: an assistant turn's tool_calls carry their arguments as
JSON text in OpenAI's API, and templates (Qwen2.5's, Llama 3's, Hermes') write them with `| tojson`, so each
arguments string that is JSON becomes the object it holds, as vLLM and transformers' examples do."""

import contextlib
import copy
import json


def template_messages(messages: list[dict]) -> list[dict]:
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message = copy.deepcopy(message)
            for call in message["tool_calls"]:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    with contextlib.suppress(json.JSONDecodeError):  # not JSON: the template gets the text
                        function["arguments"] = json.loads(function["arguments"])
        out.append(message)
    return out
