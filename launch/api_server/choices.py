"""The choices of an answer, a piece at a time (streamed) or whole: index, text, log-probabilities, and what the
request asked for on top: the prompt echoed first, vLLM's prompt_logprobs, token ids.

Choice i belongs to prompt i // n. What comes once per choice (the echo, prompt log-probabilities, prompt token
ids) rides on its first piece.
"""

from launch.api_server.generation import Piece
from launch.api_server.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs_entries, token_shower
from launch.api_server.text_model import TextModel
from launch.api_server.tools.answer import ToolAnswer
from protocol import TokenLogprobs


class _Choices:
    def __init__(self, text: TextModel, req, prompts: list[list[int]], n: int) -> None:
        self.text, self.req, self.prompts, self.n = text, req, prompts, n
        self.show = token_shower(text.decode, bool(req.return_tokens_as_token_ids))
        self.started: set[int] = set()

    def _first(self, piece: Piece) -> bool:
        first = piece.index not in self.started
        self.started.add(piece.index)
        return first

    def _extras(self, piece: Piece, first: bool, out: dict) -> dict:
        """prompt_logprobs (when asked) and token ids (return_token_ids) of the choice."""
        prompt = self.prompts[piece.index // self.n]
        if self.req.prompt_logprobs is not None:
            given = piece.prompt_logprobs if first else None
            out["prompt_logprobs"] = None if given is None else prompt_logprobs_entries(self.text.decode, prompt, given)
        if self.req.return_token_ids:
            out["token_ids"] = piece.token_ids
            if first:
                out["prompt_token_ids"] = prompt
        return out


class CompletionChoices(_Choices):
    def __init__(self, text: TextModel, req, prompts: list[list[int]], n: int, prompt_texts: list[str]) -> None:
        super().__init__(text, req, prompts, n)
        self.prompt_texts = prompt_texts  # what echo puts first: the prompt as given (decoded when given as ids)
        self.offsets: dict[int, int] = {}  # per choice: characters sent so far, for logprobs' text_offset

    def choice(self, piece: Piece, finish_reason: str | None) -> dict:
        first = self._first(piece)
        echo = first and bool(self.req.echo)
        text = (self.prompt_texts[piece.index // self.n] if echo else "") + piece.text
        logprobs = None
        if self.req.logprobs is not None:
            ids: list[int] = piece.token_ids
            entries: list[TokenLogprobs | None] = list(piece.logprobs)
            if echo:
                ids = self.prompts[piece.index // self.n] + ids
                entries = [None, *(piece.prompt_logprobs or []), *entries]
            logprobs = completion_logprobs(self.show, ids, entries, self.offsets.get(piece.index, 0))
        self.offsets[piece.index] = self.offsets.get(piece.index, 0) + len(text)
        out = {"index": piece.index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._extras(piece, first, out)


class ChatChoices(_Choices):
    def __init__(self, text: TextModel, req, prompts: list[list[int]], n: int, echo_text: str,
                 tools: ToolAnswer) -> None:
        super().__init__(text, req, prompts, n)
        self.echo_text = echo_text  # vLLM's chat echo: the last message's content, when it is the assistant's
        self.tools = tools  # content and tool_calls of the answer (launch/api_server/tools/)
        self.answers: dict[int, ToolAnswer] = {}  # streamed: each choice's own

    def _answer(self, index: int) -> ToolAnswer:
        return self.answers.setdefault(index, self.tools.fresh())

    def _logprobs(self, piece: Piece) -> dict | None:
        return chat_logprobs(self.show, piece.token_ids, piece.logprobs) if self.req.logprobs else None

    def opening(self, index: int) -> dict:
        """A stream's first chunk of a choice: the role (and the echoed message)."""
        return {"index": index, "delta": {"role": "assistant", "content": self.echo_text}, "logprobs": None,
                "finish_reason": None}

    def delta(self, piece: Piece) -> dict:
        """A streamed chunk's choice."""
        delta, finish_reason = self._answer(piece.index).delta(piece.text, piece.finish_reason)
        out = {"index": piece.index, "delta": delta, "logprobs": self._logprobs(piece), "finish_reason": finish_reason}
        return self._extras(piece, self._first(piece), out)

    def message(self, whole: Piece, finish_reason: str | None) -> dict:
        """A whole answer's choice."""
        message, finish = self.tools.fresh().message(self.echo_text + whole.text, finish_reason or "stop")
        out = {"index": whole.index, "message": message, "logprobs": self._logprobs(whole),
               "finish_reason": finish if finish_reason is not None else None}
        return self._extras(whole, self._first(whole), out)
