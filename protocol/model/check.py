"""Whether `--model` names something a worker can load, checked where the flags are read, before any process starts:
a missing path, a folder without config.json or weights, or a file that is not what its name says is one line
naming the path and the problem (before, the worker failed after start-up and the user got its log lines).

Only headers are read (config.json, each safetensors header, the GGUF magic): the check costs milliseconds.
"""

import json
from pathlib import Path

EXPECTED = "--model takes a folder with config.json and *.safetensors, or a .gguf file"
GGUF_MAGIC = b"GGUF"


class ModelPathError(ValueError):
    """--model cannot be loaded; the message is one line."""


def check_model(model: str | None) -> None:
    """Raise ModelPathError unless model is None (the built-in model), a readable HF folder or a GGUF file."""
    if model is None:
        return
    path = Path(model)
    try:
        if path.is_dir():
            _check_folder(path)
        elif path.suffix == ".gguf" and path.is_file():
            _check_gguf(path)
        elif path.exists():
            raise ModelPathError(f"{model}: not a folder or a .gguf file ({EXPECTED})")
        else:
            raise ModelPathError(f"{model}: no such file or folder ({EXPECTED})")
    except OSError as e:
        raise ModelPathError(f"{model}: cannot be read: {e.strerror or e}") from None


def _check_folder(path: Path) -> None:
    config = path / "config.json"
    if not config.is_file():
        raise ModelPathError(f"{path}: no config.json ({EXPECTED})")
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            raise ModelPathError(f"{config}: not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelPathError(f"{config}: not JSON ({e})") from None
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelPathError(f"{path}: no *.safetensors weights ({EXPECTED})")
    for file in weights:
        _check_safetensors(file)


def _check_safetensors(file: Path) -> None:
    """The header (8-byte length, then JSON) parses and the file holds every tensor's bytes it lists."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < header_len <= size - 8:
            raise ModelPathError(f"{file}: not a safetensors file (no header)")
        try:
            header = json.loads(f.read(header_len))
        except (ValueError, UnicodeDecodeError):
            raise ModelPathError(f"{file}: not a safetensors file (its header is not JSON)") from None
    try:
        end = max((t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"), default=0)
    except (AttributeError, TypeError, KeyError, IndexError):
        raise ModelPathError(f"{file}: not a safetensors file (its header lists no tensor offsets)") from None
    if 8 + header_len + end > size:
        raise ModelPathError(f"{file}: truncated ({size:,} bytes; its header lists {8 + header_len + end:,})")


def _check_gguf(path: Path) -> None:
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelPathError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")
