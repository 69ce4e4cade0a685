"""Incremental detokenisation with stop strings: text deltas that never end inside a character.

Each step decodes a short window of tokens twice (the window's settled part, and all of it) and emits the
difference; while the newest tokens decode to a partial character (U+FFFD at the end) nothing is emitted.
Stop strings are searched in the text not yet emitted, and the last len(longest stop) - 1 characters are
held back, so a stop string spanning tokens is found before any part of it leaves. As in vLLM, a stop string
ends the text before it (with include_stop_str_in_output, after it), and none is looked for until the output has
more than min_tokens tokens.
"""

from collections.abc import Callable

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 6  # prompt tokens in the first window: a tokenizer may decode a word's leading space by context


class IncrementalDetokenizer:
    def __init__(self, decode: Callable[[list[int]], str], prompt_token_ids: list[int], stop: list[str],
                 include_stop: bool = False, min_tokens: int = 0) -> None:
        self.decode = decode
        self.include_stop, self.min_tokens = include_stop, min_tokens
        self.num_tokens = 0  # output tokens so far
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # decoded output so far
        self.emitted = 0  # characters of text already handed out
        self.stopped = False  # a stop string was found; text ends before it

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """The new text that may be sent now; final: the request ended, flush everything (even a partial char)."""
        if self.stopped:
            return ""
        self.num_tokens += len(token_ids)
        self.ids += token_ids
        self.text += self._new_text(final)
        return self._release(final)

    def add_each(self, token_ids: list[int], final: bool = False) -> tuple[str, int]:
        """add, one token at a time while stop strings are looked for (several tokens come at once with speculative
        decoding): the text, and how many tokens it took (those after the one that completes a stop string are not
        part of the output, as when they come one by one)."""
        if len(token_ids) <= 1 or not self.stop:
            return self.add(token_ids, final), len(token_ids)
        text = ""
        for n, token in enumerate(token_ids, 1):
            text += self.add([token], final and n == len(token_ids))
            if self.stopped:
                return text, n
        return text, len(token_ids)

    def _new_text(self, final: bool) -> str:
        settled = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        if len(full) <= len(settled) or (full.endswith(REPLACEMENT) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(settled):]

    def _release(self, final: bool) -> str:
        found = [] if self.num_tokens <= self.min_tokens else [
            (i, i + len(s) if self.include_stop else i) for s in self.stop if (i := self.text.find(s, self.emitted)) != -1
        ]
        if found:
            self.stopped = True
            self.text = self.text[:min(found)[1]]
            end = len(self.text)
        else:
            end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
