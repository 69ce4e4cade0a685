"""A chat answer's text as OpenAI's assistant message: content and tool_calls, whole or streamed.

Streamed, content goes out as it comes until the text reaches something that may start a call (the parser's
openers; with a forced choice, from the start); the rest is held and, at the end, sent as tool_calls deltas (one
per call, with its id, name and whole arguments) or, when it holds no well-formed call, as content: a malformed
call comes back as text, never as an error.
"""

import json

from launch.api_server.errors import ApiError
from launch.api_server.tools.call import ToolCall, ToolParser, call_from
from launch.api_server.tools.choice import ToolChoice
from launch.api_server.tools.parsers import PARSERS


class ToolAnswer:
    def __init__(self, choice: ToolChoice, end_texts: tuple[str, ...] = ()) -> None:
        """end_texts: texts a decode with special tokens ends with that are not the answer's (the EOS token)."""
        self.choice = choice
        self.parser: ToolParser | None = PARSERS[choice.parser]() if choice.mode == "auto" and choice.parser else None
        self.end_texts = end_texts
        self.text, self.sent = "", 0
        self.held = choice.mode in ("required", "named")  # forced output: all of it is the calls

    def fresh(self) -> "ToolAnswer":
        """Another answer to the same request (each of n choices streams on its own)."""
        return ToolAnswer(self.choice, self.end_texts)

    @property
    def keeps_special_tokens(self) -> bool:
        return self.parser is not None and self.parser.keeps_special_tokens

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole answer; content None when the calls are all of it."""
        for end in self.end_texts:
            text = text.removesuffix(end)
        parsed = self._parse(text)
        if parsed is None:
            return text, []
        content, calls = parsed
        if not self.choice.parallel:
            calls = calls[:1]
        return (content if content.strip() else None), calls

    def _parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        mode = self.choice.mode
        if mode == "auto" and self.parser is not None:
            return self.parser.parse(text)
        if mode not in ("required", "named"):
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if mode == "named":
            call = call_from({"name": self.choice.name, "arguments": value})
            return None if call is None else ("", [call])
        calls = [call_from(v, ("parameters",)) for v in value] if isinstance(value, list) else []
        return ("", calls) if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]

    def message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The whole answer's message and its finish_reason (tool_calls where calls were made, as vLLM does)."""
        content, calls = self.calls(text)
        if not calls:
            return {"role": "assistant", "content": content}, finish_reason
        message = {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}
        return message, _finish(self.choice.mode, finish_reason)

    # ---- streamed -------------------------------------------------------------------------

    def stream(self, new_text: str) -> str:
        """The content that may go out now."""
        self.text += new_text
        if self.held:
            return ""
        starts = [at for opener in self.parser.openers if (at := self.text.find(opener, self.sent)) != -1] \
            if self.parser is not None else []
        if starts:
            self.held = True
            end = min(starts)
        else:  # a partial opener at the end waits for the next piece
            longest = max((len(o) for o in self.parser.openers), default=1) if self.parser is not None else 1
            end = max(self.sent, len(self.text) - (longest - 1))
        out, self.sent = self.text[self.sent:end], end
        return out

    def stream_end(self, finish_reason: str) -> tuple[dict, str]:
        """The last delta (the rest of the content, and the calls) and the finish_reason."""
        content, calls = self.calls(self.text)
        rest = (content or "")[self.sent:]
        delta: dict = {"content": rest} if rest else {}
        if not calls:
            return delta, finish_reason
        delta["tool_calls"] = [{"index": i, **call.openai()} for i, call in enumerate(calls)]
        return delta, _finish(self.choice.mode, finish_reason)

    def delta(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A streamed piece's delta and finish_reason (the last piece's carries the calls)."""
        content = self.stream(text)
        delta = {"content": content} if content else {}
        if finish_reason is None:
            return delta, None
        last, finish_reason = self.stream_end(finish_reason)
        if "content" in last:
            last["content"] = content + last["content"]
        return {**delta, **last}, finish_reason

    def template_kwargs(self, kwargs: dict | None) -> dict | None:
        """The chat template's arguments with the request's tools, as transformers passes them (`tools`)."""
        if not self.choice.tools:
            return kwargs
        if kwargs and "tools" in kwargs:
            raise ApiError(400, "chat_template_kwargs may not set tools: give the request's tools", "chat_template_kwargs")
        return {**(kwargs or {}), "tools": self.choice.tools}


def _finish(mode: str, finish_reason: str) -> str:
    """tool_calls for calls the model chose to make (auto, required); a named call keeps stop, as in vLLM."""
    return "tool_calls" if finish_reason == "stop" and mode != "named" else finish_reason
