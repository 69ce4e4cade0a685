"""Client-side tokenizer for a model path (HF folder with tokenizer.json, or a GGUF file).

Kept apart from the model runner: the engine core and workers only ever see token ids.
"""

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from protocol.model.gguf_meta import field, open_gguf

_GGUF_CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>


@dataclass
class TextTokenizer:
    """Text <-> token ids; special tokens are dropped when decoding."""

    tokenizer: Tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


def load_tokenizer(model: str | Path) -> TextTokenizer:
    path = Path(model)
    if path.suffix == ".gguf":
        return TextTokenizer(_gguf_tokenizer(path))
    file = path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{model}: no tokenizer.json (the built-in tiny model has no tokenizer)")
    return TextTokenizer(Tokenizer.from_file(str(file)))


def _gguf_tokenizer(path: Path) -> Tokenizer:
    """Byte-level BPE (llama.cpp `gpt2` tokenizer model) rebuilt from the GGUF vocabulary and merges."""
    _, reader = open_gguf(path)
    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    types = field(reader, "tokenizer.ggml.token_type") or []  # absent (empty): no token is special
    special = [t for t, ty in zip(tokens, types, strict=False) if ty == _GGUF_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    return tok
