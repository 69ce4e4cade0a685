"""Hermes-style calls, as Qwen2.5, Qwen3 and Hermes models write them: after optional text, one or more
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks."""

import json
import re

from launch.api_server.tools.call import ToolCall, call_from

BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


class HermesParser:
    name = "hermes"
    keeps_special_tokens = False  # <tool_call> is plain text, or a token that is not special
    openers: tuple[str, ...] = ("<tool_call>",)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        start = text.find(self.openers[0])
        if start == -1:
            return None
        calls, end = [], start
        for match in BLOCK.finditer(text, start):
            if text[end:match.start()].strip():  # only whitespace between blocks
                return None
            try:
                call = call_from(json.loads(match.group(1)))
            except json.JSONDecodeError:
                return None
            if call is None:
                return None
            calls.append(call)
            end = match.end()
        if not calls or text[end:].strip():  # an unclosed block, or text after the calls
            return None
        return text[:start], calls
