"""Llama 3.1 / 3.2 JSON calls: `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after
`<|python_tag|>`, several separated by `;`. A call starts the output or a line of it: text before it is content."""

from launch.api_server.tools.call import ToolCall, call_from, json_values

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"
    openers: tuple[str, ...] = (PYTHON_TAG, "{")
    keeps_special_tokens = True  # <|python_tag|> is one

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        tag = text.find(PYTHON_TAG)
        if tag != -1:
            calls = _calls(text[tag + len(PYTHON_TAG):])
            return None if calls is None else (text[:tag], calls)
        start = text.find("{") if text.lstrip().startswith("{") else _line_start(text, 0)
        while start != -1:
            calls = _calls(text[start:])
            if calls is not None:
                return text[:start], calls
            start = _line_start(text, start + 1)
        return None


def _line_start(text: str, at: int) -> int:
    """The next "{" that starts a line, from at; -1 if none."""
    found = text.find("\n{", at)
    return -1 if found == -1 else found + 1


def _calls(body: str) -> list[ToolCall] | None:
    calls = [call_from(v) for v in json_values(body) or []]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]
