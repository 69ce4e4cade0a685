"""Render a Hugging Face chat template with jinja2 the way transformers does.

The same environment: a sandbox, trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson`
filter that keeps non-ASCII text, and the globals `raise_exception` and `strftime_now`.
"""

import json
from datetime import datetime
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache
def compile_template(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat(source: str, messages: list[dict], add_generation_prompt: bool = True, **variables: object) -> str:
    """The prompt text; variables: bos_token, eos_token and any extra template argument.

    The template is the model's code run on the client's messages: whatever it raises (raise_exception, a
    TypeError on a field of an unexpected type, a recursion limit) is a refusal of those messages."""
    try:
        return compile_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except TemplateError as e:
        raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
    except Exception as e:  # noqa: BLE001 (the model's template, not this server, failed on these messages)
        raise ChatTemplateError(f"the chat template failed on the messages: {type(e).__name__}: {e}") from None
