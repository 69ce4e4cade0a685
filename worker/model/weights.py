"""Read named tensors, or one rank's slice of them, from safetensors files or an in-memory dict (a GGUF file's,
where quantized linear weights may stay as their blocks: read_linear gives them as they are, read dequantizes)."""

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from worker.model.gguf_quant import GGUFQuantTensor


class WeightSource:
    """Tensors by Hugging Face name; `read(name, dim, start, end)` loads only rows [start, end) of dim.
    quantization: --quantization for weights stored dense (rtn: int8 weight-only at load), or None."""

    def __init__(self, tensors: Mapping[str, torch.Tensor | GGUFQuantTensor] | None = None,
                 folder: str | Path | None = None, quantization: str | None = None):
        self._tensors = tensors or {}
        self._files: dict[str, safe_open] = {}
        self.quantization = quantization
        if folder is not None:
            for path in sorted(Path(folder).glob("*.safetensors")):
                handle = safe_open(str(path), framework="pt")
                self._files.update(dict.fromkeys(handle.keys(), handle))

    def has(self, name: str) -> bool:
        return name in self._tensors or name in self._files

    def read(self, name: str, dim: int | None = None, start: int = 0, end: int = 0) -> torch.Tensor:
        t = self.read_linear(name, dim, start, end)
        return t.dequantize() if isinstance(t, GGUFQuantTensor) else t

    def read_linear(self, name: str, dim: int | None = None, start: int = 0,
                    end: int = 0) -> torch.Tensor | GGUFQuantTensor:
        """As read, but a quantized weight stays quantized."""
        if name in self._tensors:
            t = self._tensors[name]
            return t if dim is None else t.narrow(dim, start, end - start)
        if name not in self._files:
            raise KeyError(f"weight {name!r} not found in the model files")
        handle = self._files[name]
        if dim is None:
            return handle.get_tensor(name)
        part = handle.get_slice(name)
        index = [slice(None)] * len(part.get_shape())
        index[dim] = slice(start, end)
        return part[tuple(index)]
