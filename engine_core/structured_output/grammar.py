"""A request's structured output as an llguidance grammar, and the compiler that turns it into a matcher over the
served model's vocabulary.

JSON (a schema, or any object) allows at most one space where JSON allows whitespace, so a model cannot spend its
tokens on whitespace: even a random-weight one finishes a schema within a few hundred tokens. A schema's objects
take only the properties they list unless they say otherwise (closed_schema.py), as in vLLM's default backend.
"""

import json
import re
import threading

import llguidance

from engine_core.structured_output.closed_schema import closed_objects
from engine_core.structured_output.vocabulary import tokenizer_json
from protocol import StructuredOutputsParams

JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[ ]?"}
ANY_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """The structured output is not a grammar llguidance can build: its kind (the field) and why."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"structured_outputs.{kind}: {detail}")
        self.kind, self.detail = kind, detail


def cache_key(params: StructuredOutputsParams) -> tuple[str, str]:
    kind = params.kind
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        return kind, json.dumps(params.choice)
    return kind, getattr(params, kind)


def grammar_spec(params: StructuredOutputsParams) -> str:
    """llguidance's grammar for params (not yet checked against anything); GrammarError if it cannot be built."""
    kind = params.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(closed_objects(json.loads(params.json or "")),
                                                                  defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_OBJECT, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
        if kind == "choice":
            return llguidance.grammar_from("choice", params.choice)  # type: ignore[arg-type]
        return llguidance.grammar_from("grammar", params.grammar or "")
    except ValueError as e:  # not JSON, not a JSON object, a GBNF grammar that does not convert
        raise GrammarError(kind, summary(str(e))) from None


def check(params: StructuredOutputsParams) -> None:
    """Raise GrammarError unless params compile (without the vocabulary: what a front end can check)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_spec(params))
    if error:
        raise GrammarError(params.kind, summary(error))


def summary(message: str) -> str:
    """llguidance's error on one line: its source excerpts (numbered lines, carets) left out, 500 characters at most."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line.strip("^ ") and not re.match(r"\d+ \|", line)]
    return " ".join(kept)[:500]


class GrammarCompiler:
    """Matchers over the served model's vocabulary. The vocabulary is built on first use, on the caller's thread
    (the manager's compile thread): about half a second for a 49,152-token one."""

    def __init__(self, model: str | None, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.model, self.vocab_size, self.eos_token_ids = model, vocab_size, list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(tokenizer_json(self.model), n_vocab=self.vocab_size,
                                                         eos_token=self.eos_token_ids or None)
            return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar; GrammarError if the grammar is not valid."""
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar_spec(params), log_level=0)
        if matcher.is_error():
            raise GrammarError(params.kind, summary(matcher.get_error()))
        return matcher
