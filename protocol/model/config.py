"""Model configuration read from a Hugging Face config.json (Llama and Qwen2 families)."""

from dataclasses import dataclass, field

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


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
    qkv_bias: bool
    rope_theta: float
    rope_scaling: dict | None  # llama3 parameters, or None for default RoPE
    layer_sliding_windows: list[int | None]  # per layer: window or None for full attention
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _rope(raw)
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or raw.get("attention_bias", False),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            layer_sliding_windows=_sliding_windows(raw, arch),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
        )

    def check_tp(self, tp_size: int) -> None:
        """Refuse a tensor-parallel size that does not divide the head counts."""
        for name, n in (("attention heads", self.num_attention_heads), ("KV heads", self.num_key_value_heads)):
            if n % tp_size:
                raise ValueError(
                    f"tensor parallel size {tp_size} does not divide the model's {n} {name}; "
                    f"use a size that divides both {self.num_attention_heads} and {self.num_key_value_heads}"
                )


def _rope(raw: dict) -> tuple[float, dict | None]:
    """rope_theta and llama3 scaling, from the top level (transformers 4) or rope_parameters (5)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or params
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ValueError(f"unsupported rope type {kind!r}; supported: default, llama3")
    return float(theta), dict(scaling)


def _sliding_windows(raw: dict, arch: str) -> list[int | None]:
    """Which layers slide, decided as transformers' Qwen2Config does."""
    n = raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    if arch != "Qwen2ForCausalLM" or not raw.get("use_sliding_window", False) or window is None:
        return [None] * n
    types = raw.get("layer_types") or [
        "sliding_attention" if i >= raw.get("max_window_layers", 28) else "full_attention" for i in range(n)
    ]
    return [window if t == "sliding_attention" else None for t in types]
