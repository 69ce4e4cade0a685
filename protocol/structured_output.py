"""What a request's output must match, as vLLM's StructuredOutputsParams: exactly one of a JSON schema, any JSON
object, a regular expression, a list of choices or a grammar (Lark, or GBNF as llama.cpp writes it).

The engine core compiles it (engine_core/structured_output/) and masks, at every sampled token, the tokens the
grammar does not allow; the request ends ("stop") once the grammar is complete. Bounds here are sizes only: what
the text means is checked by compiling it.
"""

from typing import Annotated

import msgspec

MAX_SPEC_CHARS = 1 << 20  # a schema, regex or grammar: one mebi-character
MAX_CHOICES, MAX_CHOICE_CHARS = 1024, 4096
KINDS = ("json", "json_object", "regex", "choice", "grammar")

Choice = Annotated[str, msgspec.Meta(max_length=MAX_CHOICE_CHARS)]
Spec = Annotated[str, msgspec.Meta(max_length=MAX_SPEC_CHARS)]


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    json: Spec | None = None  # a JSON schema, as JSON text
    regex: Spec | None = None
    choice: Annotated[list[Choice], msgspec.Meta(max_length=MAX_CHOICES)] | None = None
    grammar: Spec | None = None  # Lark or GBNF
    json_object: bool = False  # any JSON object

    def __post_init__(self) -> None:
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(given) or 'none'}")
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise ValueError(f"structured_outputs.{name} has {len(value)} characters, more than {MAX_SPEC_CHARS}")
        if self.choice is not None:
            if not self.choice:
                raise ValueError("structured_outputs.choice must not be empty")
            if len(self.choice) > MAX_CHOICES or any(len(c) > MAX_CHOICE_CHARS for c in self.choice):
                raise ValueError(f"structured_outputs.choice takes at most {MAX_CHOICES} strings of at most "
                                 f"{MAX_CHOICE_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))
