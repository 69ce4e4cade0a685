"""Client-side tokenizer for a model path (HF folder with tokenizer.json, or a GGUF file).

Kept apart from the model runner: the engine core and workers only ever see token ids.
"""

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from protocol.model.gguf_meta import open_gguf
from protocol.model.gguf_tokenizer import gguf_tokenizer


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
        _, reader = open_gguf(path)
        return TextTokenizer(gguf_tokenizer(reader, str(path)))
    file = path / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"{model}: no tokenizer.json (the built-in tiny model has no tokenizer)")
    return TextTokenizer(Tokenizer.from_file(str(file)))
