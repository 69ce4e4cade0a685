"""RoPE parameters from a config.json dict: transformers 4 form (rope_theta, rope_scaling at the top level) or 5
(rope_parameters, possibly one dict per layer type), read as transformers standardises them."""

from dataclasses import dataclass, field

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("long_factor", "short_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


@dataclass
class RopeConfig:
    """One rotary table: the base, how many leading dims of a head rotate, and the scaling type with its
    parameters (`params`, as config.json names them: factor, original_max_position_embeddings, ...)."""

    theta: float
    rotary_dim: int
    rope_type: str = "default"
    params: dict = field(default_factory=dict)
    max_position_embeddings: int = 2048  # dynamic, yarn and longrope read the model's too

    @property
    def original_max_position_embeddings(self) -> int:
        return int(self.params.get("original_max_position_embeddings") or self.max_position_embeddings)


def rope_config(raw: dict, head_dim: int, scaling: dict | None = None, theta: float | None = None) -> RopeConfig:
    """The model-wide RoPE (scaling: one layer type's dict of a nested rope_parameters, theta: its default base)."""
    params = dict(scaling if scaling is not None else raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if raw.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # as Phi3Config reads its older names
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {kind!r}; supported: {', '.join(ROPE_TYPES)}")
    missing = [k for k in _REQUIRED.get(kind, ()) if params.get(k) is None]
    if missing:
        raise ValueError(f"rope type {kind!r} needs {', '.join(missing)} in the model's rope parameters")
    if kind in ("llama3", "yarn", "longrope") and raw.get("original_max_position_embeddings"):
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]  # Phi-3's, first
    base = params.get("rope_theta") or (theta if theta is not None else raw.get("rope_theta") or 10000.0)
    partial = params.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0
    return RopeConfig(
        theta=float(base),
        rotary_dim=int(head_dim * partial),
        rope_type=kind,
        params={k: v for k, v in params.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")},
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
    )


def layer_type_ropes(raw: dict, head_dim: int, defaults: dict[str, float]) -> dict[str, RopeConfig]:
    """Per layer type (Gemma 3): rope_parameters nested by type (transformers 5), else rope_theta for full
    attention with rope_scaling, rope_local_base_freq for sliding layers (transformers 4)."""
    nested = raw.get("rope_parameters") or {}
    if all(t in nested for t in defaults):
        return {t: rope_config(raw, head_dim, nested[t], defaults[t]) for t in defaults}
    full = dict(raw.get("rope_scaling") or {})
    local = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", defaults["sliding_attention"])}
    return {
        "full_attention": rope_config(raw, head_dim, full, raw.get("rope_theta") or defaults["full_attention"]),
        "sliding_attention": rope_config(raw, head_dim, local),
    }
