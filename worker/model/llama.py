"""A decoder-only causal LM over the paged KV cache, one tensor-parallel shard per rank: embeddings, a stack of
layers (pre-norm by default, Gemma's sandwich-normed ones from worker/model/gemma.py), final norm, LM head."""

from types import ModuleType

import torch

from protocol.model.config import ModelConfig
from worker.attention_backends import Attention
from worker.kv_quant import KVCache
from worker.model.attention_block import SelfAttention
from worker.model.layers import ParallelLMHead, VocabParallelEmbedding, norm
from worker.model.layout import LLAMA, Layout
from worker.model.mlp import GatedMLP
from worker.model.moe import SparseMoE
from worker.model.rope import Rotary
from worker.model.weights import WeightSource
from worker.parallel import TPGroup


def feed_forward(cfg: ModelConfig, src: WeightSource, i: int, tp: TPGroup, ops: ModuleType | None, layout: Layout,
                 **to) -> GatedMLP | SparseMoE:
    """Layer i's MLP: a sparse MoE block where the model has one, else the dense gated MLP."""
    p = f"model.layers.{i}"
    if cfg.layer_moe[i]:
        return SparseMoE(cfg, src, f"{p}.{layout.moe_block}", tp, ops, layout, **to)
    return GatedMLP(src, f"{p}.mlp", cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias, tp, ops, layout, **to)


class DecoderLayer:
    """x + attention(norm(x)), then x + mlp(norm(x)) (Llama, Qwen, Mistral, Phi-3, SmolLM3, the MoE families)."""

    def __init__(self, cfg: ModelConfig, src: WeightSource, i: int, tp: TPGroup, ops: ModuleType | None,
                 layout: Layout, rotary: Rotary | None, **to):
        p, eps = f"model.layers.{i}", cfg.rms_norm_eps
        self.self_attn = SelfAttention(cfg, src, f"{p}.self_attn", i, tp, ops, layout, rotary, **to)
        self.mlp = feed_forward(cfg, src, i, tp, ops, layout, **to)
        self.input_norm = norm(src, f"{p}.input_layernorm", eps, cfg.norm_offset, ops, **to)
        self.post_norm = norm(src, f"{p}.post_attention_layernorm", eps, cfg.norm_offset, ops, **to)
        self.sliding_window = self.self_attn.sliding_window

    def __call__(self, x, positions, num_tokens: int, cache, meta, attention: Attention) -> torch.Tensor:
        h = self.input_norm(x)
        x, h = self.post_norm.add(x, self.self_attn(h, positions, num_tokens, cache, meta, attention))
        return x + self.mlp(h)


class LlamaModel:
    """Forward over flattened tokens; `logits` gives full-vocabulary logits on rank 0."""

    def __init__(self, cfg: ModelConfig, src: WeightSource, tp: TPGroup, max_positions: int, dtype, device,
                 ops: ModuleType | None = None, layer_type: type = DecoderLayer, layout: Layout = LLAMA):
        """ops: the CPU extension, whose fused kernels then do the norms, rotary and silu * up."""
        to = {"dtype": dtype, "device": device}
        self.cfg, self.tp = cfg, tp
        self.embed = VocabParallelEmbedding(src, "model.embed_tokens.weight", cfg.vocab_size, tp, **to)
        self.embed_scale = None if cfg.embed_scale is None else torch.tensor(cfg.embed_scale, **to)
        ropes = rotary_tables(cfg, max_positions, device, ops)
        self.layers = [layer_type(cfg, src, i, tp, ops, layout, ropes[i], **to) for i in range(cfg.num_hidden_layers)]
        self.norm = norm(src, "model.norm", cfg.rms_norm_eps, cfg.norm_offset, ops, **to)
        head_name = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        if not cfg.tie_word_embeddings and not src.has(head_name):
            head_name = "model.embed_tokens.weight"  # some checkpoints tie without saying so
        self.lm_head = ParallelLMHead(src, head_name, cfg.vocab_size, tp, **to)

    @property
    def kv_heads_per_rank(self) -> int:
        return self.cfg.num_key_value_heads // self.tp.size

    @property
    def cuda_graphs(self) -> bool:
        """Whether its decode steps can be captured: not with MoE layers, whose routing reads counts on the host."""
        return not any(self.cfg.layer_moe)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        num_tokens: int,
        caches: list[KVCache],
        metas: list,
        attention: Attention,
    ) -> torch.Tensor:
        """The first num_tokens of input_ids are the step's tokens, the rest padding; caches[i] and metas[i] (the
        attention backend's metadata) belong to layer i. Returns the final hidden states of the step's tokens."""
        x = self.embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        for layer, cache, meta in zip(self.layers, caches, metas, strict=True):
            x = layer(x, positions, num_tokens, cache, meta, attention)
        return self.norm(x[:num_tokens])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head.logits(hidden)
        cap = self.cfg.final_softcap
        return logits if logits is None or cap is None else torch.tanh(logits / cap) * cap


def rotary_tables(cfg: ModelConfig, max_positions: int, device, ops: ModuleType | None) -> list[Rotary | None]:
    """Per layer its rotary table, one table per distinct rope (Gemma 3: local and global)."""
    tables: list[tuple[object, Rotary]] = []
    out: list[Rotary | None] = []
    for rope in cfg.layer_ropes:
        if rope is None:
            out.append(None)
            continue
        found = next((t for r, t in tables if r == rope), None)
        if found is None:
            found = Rotary(rope, max_positions, device, ops)
            tables.append((rope, found))
        out.append(found)
    return out
