"""A tool call as the API returns it (OpenAI's shape) and the parser interface every format implements."""

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Protocol

ALPHANUMERIC = string.ascii_letters + string.digits


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=call_id)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser(Protocol):
    """Finds the tool calls in a model's whole output."""

    name: str
    openers: tuple[str, ...]  # texts that may start the calls: streamed content is held back from the first on
    keeps_special_tokens: bool  # the output is decoded with special tokens, the format's markers being some

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, the calls), or None when the text holds no well-formed call (then it is
        content as it is)."""
        ...


def call_from(obj: object, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from a decoded {"name": ..., "arguments"/"parameters": {...}}; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def json_values(text: str) -> list[object] | None:
    """The JSON values of text, one after another, separated by whitespace or ';' (Llama 3's separator); None
    unless the whole text is such values."""
    decoder, i = json.JSONDecoder(), 0
    values: list[object] = []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)
