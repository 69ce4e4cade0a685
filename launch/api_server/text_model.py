"""The text side of the served model: tokenizer, chat template and special tokens, from the model path."""

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from launch.api_server.chat_template import render_chat
from protocol.model.builtin_tokenizer import CHAT_TEMPLATE, builtin_tokenizer
from protocol.model.gguf_meta import field as gguf_field
from protocol.model.gguf_meta import open_gguf
from protocol.model.tokenizer import load_tokenizer


@dataclass
class TextModel:
    tokenizer: Tokenizer
    chat_template: str | None
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token for the template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def eos_token_id(self) -> int | None:
        """The model's EOS token, as its special tokens name it (None if they do not)."""
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.tokenizer.token_to_id(eos)

    @cached_property
    def longest_token_chars(self) -> int:
        """Characters of the vocabulary's longest token string: one token covers at most this many of a text."""
        return max(len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, template: str | None = None,
                    **variables: object) -> str:
        """With the model's template, or the given one (a request's chat_template), in the same sandbox."""
        template = template or self.chat_template
        if template is None:
            raise ValueError("this model has no chat template (give one with --chat-template or chat_template), "
                             "or use /v1/completions")
        return render_chat(template, messages, add_generation_prompt, **self.special_tokens, **variables)


def chat_template_text(given: str) -> str:
    """--chat-template: the template's text, or a file holding it (as vLLM tells them apart: a template has
    Jinja's braces, a path has none); raises OSError for a file it cannot read."""
    return given if "{" in given else Path(given).read_text()


def load_text_model(model: str | None) -> TextModel:
    """From a Hugging Face folder (tokenizer.json, tokenizer_config.json), a GGUF file, or None (built-in)."""
    if model is None:
        return TextModel(builtin_tokenizer(), CHAT_TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"})
    tokenizer = load_tokenizer(model).tokenizer
    path = Path(model)
    if path.suffix == ".gguf":
        return _gguf_text_model(path, tokenizer)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    template = config.get("chat_template")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    specials = {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}
    return TextModel(tokenizer, template, {k: v for k, v in specials.items() if v is not None})


def _token_text(token: object) -> str | None:
    """A tokenizer_config.json special token: a string or an AddedToken dict with 'content'."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _gguf_text_model(path: Path, tokenizer: Tokenizer) -> TextModel:
    _, reader = open_gguf(path)
    tokens = gguf_field(reader, "tokenizer.ggml.tokens")
    specials = {}
    for name in ("bos", "eos"):
        token_id = gguf_field(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            specials[f"{name}_token"] = tokens[token_id]
    return TextModel(tokenizer, gguf_field(reader, "tokenizer.chat_template"), specials)
