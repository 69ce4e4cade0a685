"""Mistral calls: `[TOOL_CALLS]` then a JSON array of {"name", "arguments"} (Mistral 7B v0.3, Mixtral, Nemo), or
then `name[ARGS]{...}` for each call (the tokenizer of Mistral Small 3.1 and later)."""

import json
import secrets

from launch.api_server.tools.call import ALPHANUMERIC, ToolCall, call_from, json_values

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


def mistral_id() -> str:
    """Mistral's templates take 9 letters and digits as a call's id."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


class MistralParser:
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] is one
    openers: tuple[str, ...] = (TOOL_CALLS,)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        start = text.find(TOOL_CALLS)
        if start == -1:
            return None
        body = text[start + len(TOOL_CALLS):].strip()
        calls = _array_calls(body) if body.startswith("[") else _named_calls(body)
        if not calls:
            return None
        for call in calls:
            call.id = mistral_id()
        return text[:start], calls


def _array_calls(body: str) -> list[ToolCall] | None:
    values = json_values(body)
    if not values or len(values) != 1 or not isinstance(values[0], list):
        return None
    calls = [call_from(v) for v in values[0]]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


def _named_calls(body: str) -> list[ToolCall] | None:
    """`name[ARGS]{...}`, repeated (each call after the first with its own [TOOL_CALLS])."""
    calls = []
    for part in body.split(TOOL_CALLS):
        name, sep, arguments = part.strip().partition(ARGS)
        if not sep or not name.strip():
            return None
        values = json_values(arguments)
        if not values or len(values) != 1 or not isinstance(values[0], dict):
            return None
        calls.append(ToolCall(name.strip(), json.dumps(values[0], ensure_ascii=False)))
    return calls
