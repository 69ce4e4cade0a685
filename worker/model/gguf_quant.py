"""GGUF tensors kept as their quantized blocks (Q8_0, Q4_0, Q4_1, Q4_K) rather than dequantized at load: sliced by
rows, or by whole blocks of columns, for tensor parallelism, and decoded into the code + scale forms that
worker/ops/quant_linear.py multiplies. Q4_0 (d * (q - 8)), Q4_1 (d * q + m) and Q4_K (d * sc * q - dmin * m per
sub-block of 32) all become int4 codes with a scale and zero per 32 inputs, w = (q - 8) * scale + zero; Q8_0 is
int8 codes with a scale per 32."""

from dataclasses import dataclass

import numpy as np
import torch

KEPT = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
_BLOCK = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}  # elements, bytes


@dataclass(frozen=True)
class GGUFQuantTensor:
    name: str  # the Hugging Face name, for errors
    qtype: str
    data: np.ndarray  # uint8 [rows, row bytes]

    @property
    def shape(self) -> tuple[int, int]:
        elements, size = _BLOCK[self.qtype]
        return self.data.shape[0], self.data.shape[1] // size * elements

    def narrow(self, dim: int, start: int, length: int) -> "GGUFQuantTensor":
        """Rows (dim 0), or columns (dim 1) on block boundaries; a column range that splits a block is refused."""
        if dim == 0:
            return GGUFQuantTensor(self.name, self.qtype, self.data[start : start + length])
        elements, size = _BLOCK[self.qtype]
        if start % elements or length % elements:
            raise ValueError(f"{self.name} ({self.qtype}, blocks of {elements} inputs) cannot be split at input "
                             f"columns {start}..{start + length} for tensor parallelism: not on a block boundary")
        first = start // elements * size
        return GGUFQuantTensor(self.name, self.qtype, self.data[:, first : first + length // elements * size])

    def dequantize(self) -> torch.Tensor:
        import gguf

        qtype = gguf.GGMLQuantizationType[self.qtype]
        return torch.from_numpy(gguf.quants.dequantize(self.data, qtype).astype(np.float32))

    def int4_form(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes [n, k] (0..15), scale and zero [n, k / 32] with w = (q - 8) * scale + zero."""
        rows = self.data.shape[0]
        if self.qtype == "Q4_K":
            q, scale, zero = _q4_k(self.data.reshape(rows, -1, 144))
        else:
            blocks = self.data.reshape(rows, -1, _BLOCK[self.qtype][1])
            d = _f16(blocks, 0)
            q = _nibbles(blocks[..., -16:])
            scale, zero = d, np.zeros_like(d) if self.qtype == "Q4_0" else _f16(blocks, 2) + 8 * d  # Q4_1: m + 8d
        return (torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(scale.reshape(rows, -1)),
                torch.from_numpy(zero.reshape(rows, -1)))

    def int8_form(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Q8_0's codes [n, k] int8 and scales [n, k / 32]."""
        rows = self.data.shape[0]
        blocks = self.data.reshape(rows, -1, 34)
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        return torch.from_numpy(q.reshape(rows, -1)), torch.from_numpy(_f16(blocks, 0).reshape(rows, -1))


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte offset of each block, as float32 [..., blocks]."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes a block -> 32 codes: the low nibbles are elements 0..15, the high ones 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [rows, nb, 144] -> codes [rows, nb, 256], scale and zero [rows, nb, 8]."""
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    packed = blocks[..., 4:16].astype(np.uint8)
    low, high = packed[..., :4], packed[..., 4:8]
    sc_hi = np.concatenate([low & 63, (packed[..., 8:] & 15) | ((low >> 6) << 4)], axis=-1)
    m_hi = np.concatenate([high & 63, (packed[..., 8:] >> 4) | ((high >> 6) << 4)], axis=-1)
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=-2).reshape(*blocks.shape[:-1], 256)  # sub-blocks 2j, 2j + 1
    scale = d * sc_hi.astype(np.float32)
    zero = -dmin * m_hi.astype(np.float32) + 8 * scale
    return q, scale, zero
