"""A decoder layer's self-attention: q, k, v projections (separate or fused weights), optional q/k norms and
clipping, rotary, paged attention over the layer's cache (scaled and soft-capped as the model says), output
projection; heads split across tensor-parallel ranks."""

from types import ModuleType

import torch
import torch.nn.functional as F

from protocol.model.config import ModelConfig
from worker.attention_backends import Attention
from worker.model.layers import ColumnParallelLinear, RMSNorm, RowParallelLinear, fused, norm, separate
from worker.model.layout import Layout
from worker.model.rope import Rotary
from worker.model.weights import WeightSource
from worker.parallel import TPGroup, shard_range


class ProjectionNorm:
    """RMS norm over a whole projection, all heads together (OLMoE), whose features are split across ranks: the
    sum of squares is all-reduced."""

    def __init__(self, weight: torch.Tensor, full_size: int, eps: float, tp: TPGroup):
        self.weight, self.full_size, self.eps, self.tp = weight, full_size, eps, tp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.tp.size == 1:
            variance = h.pow(2).mean(-1, keepdim=True)
        else:
            variance = self.tp.all_reduce(h.pow(2).sum(-1, keepdim=True)) / self.full_size
        return self.weight * (h * torch.rsqrt(variance + self.eps)).to(x.dtype)


class SelfAttention:
    def __init__(self, cfg: ModelConfig, src: WeightSource, prefix: str, i: int, tp: TPGroup, ops: ModuleType | None,
                 layout: Layout, rotary: Rotary | None, **to):
        hd = cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads // tp.size, cfg.num_key_value_heads // tp.size
        self.head_dim = hd
        self.per_head_norm = cfg.qk_norm == "head"
        self.scale, self.softcap, self.clip = cfg.scale, cfg.attn_softcap, cfg.clip_qkv
        self.sliding_window, self.rotary = cfg.layer_sliding_windows[i], rotary
        q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        sizes = [q_out, kv_out, kv_out]
        parts = fused(f"{prefix}.qkv_proj", sizes) if layout.fused_qkv else separate(
            [f"{prefix}.q_proj", f"{prefix}.k_proj", f"{prefix}.v_proj"], sizes)
        self.qkv = ColumnParallelLinear(src, parts, tp, cfg.qkv_bias, **to)
        self.o_proj = RowParallelLinear(src, f"{prefix}.o_proj", q_out, tp, cfg.o_bias, **to)
        self.q_norm: RMSNorm | ProjectionNorm | None = None
        self.k_norm: RMSNorm | ProjectionNorm | None = None
        if cfg.qk_norm == "head":
            self.q_norm = norm(src, f"{prefix}.q_norm", cfg.rms_norm_eps, cfg.norm_offset, ops, **to)
            self.k_norm = norm(src, f"{prefix}.k_norm", cfg.rms_norm_eps, cfg.norm_offset, ops, **to)
        elif cfg.qk_norm == "all":
            self.q_norm = _projection_norm(src, f"{prefix}.q_norm", q_out, cfg, tp, ops, **to)
            self.k_norm = _projection_norm(src, f"{prefix}.k_norm", kv_out, cfg, tp, ops, **to)

    def __call__(self, h, positions, num_tokens: int, cache, meta, attention: Attention) -> torch.Tensor:
        """Rows past num_tokens are padding: they go through the matmuls but not through attention."""
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv(h).split_with_sizes([q_size, kv_size, kv_size], dim=-1)  # Tensor.split: 3x the overhead
        q, k = self._norm(q, k)
        if self.clip is not None:
            q, k, v = (x.clamp(-self.clip, self.clip) for x in (q, k, v))
        q, k = q.view(-1, self.heads, self.head_dim), k.view(-1, self.kv_heads, self.head_dim)
        if self.rotary is not None:
            q, k = self.rotary.apply(q, k, positions)
        v = v.view(-1, self.kv_heads, self.head_dim)
        padded = num_tokens < h.shape[0]  # sliced only then: a decode step pays for every op of every layer
        if padded:
            q, k, v = q[:num_tokens], k[:num_tokens], v[:num_tokens]
        o = attention(q, k, v, cache, meta, self.scale, self.softcap)
        return self.o_proj(F.pad(o, (0, 0, 0, h.shape[0] - num_tokens)) if padded else o)

    def _norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.q_norm is None or self.k_norm is None:
            return q, k
        if self.per_head_norm:
            hd = self.head_dim
            return self.q_norm(q.reshape(-1, hd)).view(q.shape), self.k_norm(k.reshape(-1, hd)).view(k.shape)
        return self.q_norm(q), self.k_norm(k)


def _projection_norm(src: WeightSource, name: str, size: int, cfg: ModelConfig, tp: TPGroup,
                     ops: ModuleType | None, **to) -> RMSNorm | ProjectionNorm:
    if tp.size == 1:
        return norm(src, name, cfg.rms_norm_eps, cfg.norm_offset, ops, **to)
    start, end = shard_range(size, tp.rank, tp.size)
    return ProjectionNorm(src.read(f"{name}.weight", 0, start, end).to(**to), size, cfg.rms_norm_eps, tp)
