"""Rotary position embedding: cos/sin tables per position for each rope type transformers names (default, linear,
dynamic, yarn, longrope, llama3), applied rotate-half to a head's first rotary_dim dims.

dynamic and longrope change their frequencies with the sequence length in transformers (the longest position
of the forward): here the row of position p is computed for a sequence of p + 1 tokens, which equals transformers
for every decode step and for a prompt's last token (earlier tokens of a prompt longer than the original context
are rotated as a decode step at their position would be, as the cache would hold them had they been decoded).
"""

import math
from types import ModuleType

import torch

from protocol.model.rope_config import RopeConfig


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def llama3_inv_freq(inv_freq: torch.Tensor, p: dict, old_len: int) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between."""
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated frequencies for long wavelengths, extrapolated for short, a linear ramp between;
    cos and sin scaled by the attention factor."""
    p, dim, base = rope.params, rope.rotary_dim, rope.theta
    factor = p.get("factor") or rope.max_position_embeddings / rope.original_max_position_embeddings
    attention = p.get("attention_factor")
    if attention is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all \
            else _yarn_mscale(factor, 1.0)
    old_len = rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return inv_freq, float(attention)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def dynamic_inv_freq(rope: RopeConfig, max_positions: int) -> torch.Tensor:
    """[positions, dim / 2]: NTK-scaled base for a sequence of p + 1 tokens past max_position_embeddings."""
    dim, factor, limit = rope.rotary_dim, rope.params["factor"], rope.max_position_embeddings
    length = torch.arange(1, max_positions + 1).clamp(min=limit).float()
    bases = rope.theta * ((factor * length / limit) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (bases.unsqueeze(1) ** _exponents(dim))


def longrope_inv_freq(rope: RopeConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    """[positions, dim / 2]: short factors up to the original context, long ones past it."""
    p, old_len = rope.params, rope.original_max_position_embeddings
    factor = p.get("factor") or rope.max_position_embeddings / old_len
    attention = p.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    shape = rope.theta ** _exponents(rope.rotary_dim)
    short = 1.0 / (torch.tensor(p["short_factor"], dtype=torch.float32) * shape)
    long = 1.0 / (torch.tensor(p["long_factor"], dtype=torch.float32) * shape)
    beyond = (torch.arange(max_positions) + 1 > old_len).unsqueeze(1)
    return torch.where(beyond, long, short), float(attention)


def inv_freq_of(rope: RopeConfig, max_positions: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ([dim / 2], or [positions, dim / 2]) and the factor on cos and sin."""
    kind = rope.rope_type
    if kind == "yarn":
        return yarn_inv_freq(rope)
    if kind == "longrope":
        return longrope_inv_freq(rope, max_positions)
    if kind == "dynamic":
        return dynamic_inv_freq(rope, max_positions), 1.0
    inv_freq = default_inv_freq(rope.theta, rope.rotary_dim)
    if kind == "linear":
        return inv_freq / rope.params["factor"], 1.0
    if kind == "llama3":
        return llama3_inv_freq(inv_freq, rope.params, rope.original_max_position_embeddings), 1.0
    return inv_freq, 1.0


class Rotary:
    """Rotate-half RoPE with a cos/sin table per position; only a head's first rotary_dim dims rotate."""

    def __init__(self, rope: RopeConfig, max_positions: int, device, ops: ModuleType | None = None):
        self.ops, self.rotary_dim = ops, rope.rotary_dim
        inv_freq, attention_factor = inv_freq_of(rope, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32).unsqueeze(1) * inv_freq
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = (emb.cos() * attention_factor).to(device), (emb.sin() * attention_factor).to(device)

    def apply(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q, k: [tokens, heads, head_dim], rotated (fused: in place)."""
        rd = self.rotary_dim
        if self.ops is not None:
            whole = rd == q.shape[-1]  # no slicing then: a slice costs as much as the kernel at batch 1
            self.ops.rotary(q if whole else q[..., :rd], k if whole else k[..., :rd], positions, self.cos, self.sin)
            return q, k
        if rd == q.shape[-1]:
            return self(q, positions), self(k, positions)

        def partial(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self(x[..., :rd], positions), x[..., rd:]], dim=-1)

        return partial(q), partial(k)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [tokens, heads, rotary_dim]."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
