"""Building blocks of a Llama-family decoder, sharded for tensor parallelism."""

import math
from types import ModuleType

import torch
import torch.nn.functional as F

from worker.model.weights import WeightSource
from worker.parallel import TPGroup, shard_range


class RMSNorm:
    """ops: the CPU extension, whose fused kernels replace the torch ops below (same rounding), or None."""

    def __init__(self, weight: torch.Tensor, eps: float, ops: ModuleType | None = None):
        self.weight, self.eps, self.ops = weight, eps, ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: (x + delta, its norm); fused, x is updated in place."""
        if self.ops is not None:
            return x, self.ops.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


def silu_and_mul(x: torch.Tensor, ops: ModuleType | None) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of x's last dim."""
    if ops is not None:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class ColumnParallelLinear:
    """Output features split across ranks; several HF weights may be fused along the output dim."""

    def __init__(self, src: WeightSource, names: list[str], sizes: list[int], tp: TPGroup, bias: bool, **to):
        weights, biases = [], []
        for name, size in zip(names, sizes, strict=True):
            start, end = shard_range(size, tp.rank, tp.size)
            weights.append(src.read(f"{name}.weight", 0, start, end))
            if bias:
                biases.append(src.read(f"{name}.bias", 0, start, end))
        self.weight = torch.cat(weights).to(**to)
        self.bias = torch.cat(biases).to(**to) if bias else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear:
    """Input features split across ranks; partial outputs summed with an all-reduce."""

    def __init__(self, src: WeightSource, name: str, size_in: int, tp: TPGroup, **to):
        start, end = shard_range(size_in, tp.rank, tp.size)
        self.weight = src.read(f"{name}.weight", 1, start, end).to(**to)
        self.tp = tp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding:
    """Rows of the vocabulary split across ranks (padded to a multiple of the TP size)."""

    def __init__(self, src: WeightSource, name: str, vocab_size: int, tp: TPGroup, **to):
        per = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * per
        end = min(self.start + per, vocab_size)
        rows = src.read(name, 0, self.start, end).to(**to)
        self.weight = torch.cat([rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])])
        self.vocab_size, self.tp = vocab_size, tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0 (None elsewhere), as a vocab-parallel LM head."""
        full = self.tp.gather_last_dim(F.linear(h, self.weight))
        return None if full is None else full[..., : self.vocab_size]


class Rotary:
    """Rotate-half RoPE with a cos/sin table per position (default or Llama 3 frequencies)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_positions: int, device,
                 ops: ModuleType | None = None):
        self.ops = ops
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [tokens, heads, head_dim], rotated (fused: in place)."""
        if self.ops is not None:
            self.ops.rotary(q, k, positions, self.cos, self.sin)
            return q, k
        return self(q, positions), self(k, positions)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, head_dim]."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


def llama3_inv_freq(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
