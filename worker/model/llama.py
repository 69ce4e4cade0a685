"""Llama / Qwen2 decoder over the paged KV cache, one tensor-parallel shard per rank."""

from types import ModuleType

import torch
import torch.nn.functional as F

from protocol.model.config import ModelConfig
from worker.attention_backends import Attention
from worker.model.layers import (
    ColumnParallelLinear,
    RMSNorm,
    Rotary,
    RowParallelLinear,
    VocabParallelEmbedding,
    silu_and_mul,
)
from worker.model.weights import WeightSource
from worker.parallel import TPGroup


class DecoderLayer:
    def __init__(self, cfg: ModelConfig, src: WeightSource, i: int, tp: TPGroup, ops: ModuleType | None, **to):
        p = f"model.layers.{i}"
        hd = cfg.head_dim
        self.heads, self.kv_heads = cfg.num_attention_heads // tp.size, cfg.num_key_value_heads // tp.size
        self.head_dim, self.scale = hd, hd**-0.5
        self.sliding_window = cfg.layer_sliding_windows[i]
        q_out, kv_out = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        attn = f"{p}.self_attn"
        self.qkv = ColumnParallelLinear(
            src, [f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"], [q_out, kv_out, kv_out], tp, cfg.qkv_bias, **to
        )
        self.o_proj = RowParallelLinear(src, f"{attn}.o_proj", q_out, tp, **to)
        mlp, inter = f"{p}.mlp", cfg.intermediate_size
        self.gate_up = ColumnParallelLinear(
            src, [f"{mlp}.gate_proj", f"{mlp}.up_proj"], [inter, inter], tp, False, **to
        )
        self.down = RowParallelLinear(src, f"{mlp}.down_proj", inter, tp, **to)
        self.input_norm = RMSNorm(src.read(f"{p}.input_layernorm.weight").to(**to), cfg.rms_norm_eps, ops)
        self.post_norm = RMSNorm(src.read(f"{p}.post_attention_layernorm.weight").to(**to), cfg.rms_norm_eps, ops)
        self.ops = ops

    def __call__(self, x, positions, num_tokens: int, rotary, cache, meta, attention: Attention):
        """Rows past num_tokens are padding: they go through the matmuls but not through attention."""
        h = self.input_norm(x)
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.qkv(h).split([q_size, kv_size, kv_size], dim=-1)
        q, k = rotary.apply(q.view(-1, self.heads, self.head_dim), k.view(-1, self.kv_heads, self.head_dim), positions)
        v = v.view(-1, self.kv_heads, self.head_dim)
        o = attention(q[:num_tokens], k[:num_tokens], v[:num_tokens], cache, meta, self.scale)
        if num_tokens < x.shape[0]:
            o = F.pad(o, (0, 0, 0, x.shape[0] - num_tokens))
        x, h = self.post_norm.add(x, self.o_proj(o))
        return x + self.down(silu_and_mul(self.gate_up(h), self.ops))


class LlamaModel:
    """Forward over flattened tokens; `logits` gives full-vocabulary logits on rank 0."""

    def __init__(self, cfg: ModelConfig, src: WeightSource, tp: TPGroup, max_positions: int, dtype, device,
                 ops: ModuleType | None = None):
        """ops: the CPU extension, whose fused kernels then do the norms, rotary and silu * up."""
        to = {"dtype": dtype, "device": device}
        self.cfg, self.tp = cfg, tp
        self.embed = VocabParallelEmbedding(src, "model.embed_tokens.weight", cfg.vocab_size, tp, **to)
        self.layers = [DecoderLayer(cfg, src, i, tp, ops, **to) for i in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(src.read("model.norm.weight").to(**to), cfg.rms_norm_eps, ops)
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        if not cfg.tie_word_embeddings and not src.has(head_name):
            head_name = "model.embed_tokens.weight"  # some checkpoints tie without saying so
        self.lm_head = VocabParallelEmbedding(src, head_name, cfg.vocab_size, tp, **to)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, device, ops)

    @property
    def kv_heads_per_rank(self) -> int:
        return self.cfg.num_key_value_heads // self.tp.size

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        num_tokens: int,
        caches: list[torch.Tensor],
        metas: list,
        attention: Attention,
    ) -> torch.Tensor:
        """The first num_tokens of input_ids are the step's tokens, the rest padding; caches[i] and metas[i] (the
        attention backend's metadata) belong to layer i. Returns the final hidden states of the step's tokens."""
        x = self.embed(input_ids)
        for layer, cache, meta in zip(self.layers, caches, metas, strict=True):
            x = layer(x, positions, num_tokens, self.rotary, cache, meta, attention)
        return self.norm(x[:num_tokens])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head.logits(hidden)
