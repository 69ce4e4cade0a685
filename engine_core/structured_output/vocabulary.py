"""The served model's tokenizer, as the JSON text llguidance builds its vocabulary from: the same tokenizer the
API server encodes with (protocol/model/), so that a grammar's tokens are the model's."""

from protocol.model.builtin_tokenizer import builtin_tokenizer
from protocol.model.tokenizer import load_tokenizer


def tokenizer_json(model: str | None) -> str:
    """model: a Hugging Face folder or GGUF file; None for the built-in tiny model's byte-level tokenizer."""
    if model is None:
        return builtin_tokenizer().to_str()
    return load_tokenizer(model).tokenizer.to_str()
