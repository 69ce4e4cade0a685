"""Model configuration read from a Hugging Face config.json, for the architectures kvengine serves natively."""

from dataclasses import dataclass, field

from protocol.model.families import FAMILIES
from protocol.model.rope_config import RopeConfig, rope_config

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


class UnsupportedArchitecture(ValueError):
    """No native implementation serves this architecture (the transformers fallback may)."""


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_sliding_windows: list[int | None]  # per layer: window or None for full attention
    layer_ropes: list[RopeConfig | None]  # per layer: its rotary table, or None for a layer without one
    eos_token_ids: list[int] = field(default_factory=list)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    qk_norm: str | None = None  # "head": RMS norm of each head of q and k; "all": over the whole projection
    clip_qkv: float | None = None  # q, k and v clamped to [-clip_qkv, clip_qkv]
    norm_offset: float = 0.0  # Gemma: norms scale by 1 + weight
    sandwich_norms: bool = False  # Gemma 2 / 3: the attention and MLP outputs are normed too, and the MLP input
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_softcap: float | None = None  # attention scores capped to (-c, c) by c * tanh(s / c)
    final_softcap: float | None = None  # the same on the logits
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the chosen experts' weights renormalised to sum to 1
    layer_moe: list[bool] = field(default_factory=list)  # per layer: a sparse MoE block instead of the dense MLP

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        family = FAMILIES.get(arch)
        if family is None:
            raise UnsupportedArchitecture(
                f"unsupported architecture {arch!r}; supported natively: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        common = common_fields(raw, arch)
        fields = family(raw, common["head_dim"])
        n = common["num_hidden_layers"]
        if "layer_ropes" not in fields:
            fields["layer_ropes"] = [rope_config(raw, common["head_dim"])] * n
        fields.setdefault("layer_moe", [False] * n)
        cfg = cls(**{**common, **fields})
        cfg.check()
        return cfg

    @property
    def scale(self) -> float:
        return self.attn_scale or self.head_dim**-0.5

    def check(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        for rope in self.layer_ropes:
            if rope is not None and (rope.rotary_dim % 2 or rope.rotary_dim > self.head_dim):
                raise ValueError(f"rotary dim {rope.rotary_dim} must be even and at most head_dim {self.head_dim}")

    def check_tp(self, tp_size: int) -> None:
        """Refuse a tensor-parallel size that does not divide the head counts (or the MLP widths)."""
        for name, n in (("attention heads", self.num_attention_heads), ("KV heads", self.num_key_value_heads)):
            if n % tp_size:
                raise ValueError(
                    f"tensor parallel size {tp_size} does not divide the model's {n} {name}; "
                    f"use a size that divides both {self.num_attention_heads} and {self.num_key_value_heads}"
                )
        widths = [("intermediate_size", self.intermediate_size), ("moe_intermediate_size", self.moe_intermediate_size)]
        for name, n in widths:
            if n % tp_size:
                raise ValueError(f"tensor parallel size {tp_size} does not divide the model's {name} {n}")


def common_fields(raw: dict, arch: str) -> dict:
    """The fields every architecture reads alike."""
    heads = raw["num_attention_heads"]
    n = raw["num_hidden_layers"]
    eos = raw.get("eos_token_id")
    return {
        "architecture": arch,
        "vocab_size": raw["vocab_size"],
        "hidden_size": raw["hidden_size"],
        "intermediate_size": raw.get("intermediate_size") or 0,
        "num_hidden_layers": n,
        "num_attention_heads": heads,
        "num_key_value_heads": raw.get("num_key_value_heads") or heads,
        "head_dim": raw.get("head_dim") or raw["hidden_size"] // heads,
        "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": raw.get("max_position_embeddings", 2048),
        "tie_word_embeddings": raw.get("tie_word_embeddings", False),
        "hidden_act": raw.get("hidden_act") or "silu",
        "layer_sliding_windows": [None] * n,
        "eos_token_ids": [] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
    }
