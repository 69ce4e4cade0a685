"""Open a GGUF file and read its metadata fields; no torch, so the client-side tokenizer can use it."""

from pathlib import Path


def open_gguf(path: str | Path):
    """(the gguf module, a GGUFReader over path); a clear message when the optional extra is missing."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading a .gguf file needs the optional extra: pip install 'kvengine[gguf]'") from e
    return gguf, gguf.GGUFReader(str(path))


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()
