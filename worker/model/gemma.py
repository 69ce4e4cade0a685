"""Gemma 2 and 3 decoder layers: sandwich norms (before and after both attention and the MLP), each scaling by
1 + weight; the rest (GeGLU, scaled embeddings, soft-capping, local/global layers) is configuration that
LlamaModel, SelfAttention and GatedMLP read."""

from types import ModuleType

import torch

from protocol.model.config import ModelConfig
from worker.attention_backends import Attention
from worker.model.attention_block import SelfAttention
from worker.model.layers import norm
from worker.model.layout import Layout
from worker.model.llama import feed_forward
from worker.model.rope import Rotary
from worker.model.weights import WeightSource
from worker.parallel import TPGroup


class GemmaDecoderLayer:
    """x + post_attn_norm(attention(input_norm(x))), then x + post_ffn_norm(mlp(pre_ffn_norm(x)))."""

    def __init__(self, cfg: ModelConfig, src: WeightSource, i: int, tp: TPGroup, ops: ModuleType | None,
                 layout: Layout, rotary: Rotary | None, **to):
        p = f"model.layers.{i}"
        self.self_attn = SelfAttention(cfg, src, f"{p}.self_attn", i, tp, ops, layout, rotary, **to)
        self.mlp = feed_forward(cfg, src, i, tp, ops, layout, **to)
        self.input_norm, self.post_attention_norm, self.pre_ffn_norm, self.post_ffn_norm = (
            norm(src, f"{p}.{name}", cfg.rms_norm_eps, cfg.norm_offset, ops, **to)
            for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                         "post_feedforward_layernorm")
        )
        self.sliding_window = self.self_attn.sliding_window

    def __call__(self, x, positions, num_tokens: int, cache, meta, attention: Attention) -> torch.Tensor:
        attended = self.self_attn(self.input_norm(x), positions, num_tokens, cache, meta, attention)
        x, h = self.pre_ffn_norm.add(x, self.post_attention_norm(attended))
        return x + self.post_ffn_norm(self.mlp(h))
