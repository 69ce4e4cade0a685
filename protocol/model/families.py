"""What sets each natively served architecture apart, read from its config.json dict as its transformers
config class reads it: which layers slide, which rotate (and with which table), the attention scale, norms,
soft-capping and mixture-of-experts. Each reader takes (raw, head_dim) and returns the ModelConfig fields that
differ from the defaults; where it gives no layer_ropes, every layer uses rope_config(raw, head_dim)."""

from protocol.model.rope_config import layer_type_ropes, rope_config

SLIDING, FULL = "sliding_attention", "full_attention"


def _every_layer(raw: dict, value) -> list:
    return [value] * raw["num_hidden_layers"]


def _by_layer_type(raw: dict, types: list[str]) -> list[int | None]:
    window = raw.get("sliding_window")
    return [window if t == SLIDING else None for t in types]


def _qwen_windows(raw: dict) -> list[int | None]:
    """Qwen2 / Qwen3: layers from max_window_layers on slide, when use_sliding_window is set."""
    n = raw["num_hidden_layers"]
    if not raw.get("use_sliding_window", False) or raw.get("sliding_window") is None:
        return [None] * n
    start = raw.get("max_window_layers", 28)
    return _by_layer_type(raw, raw.get("layer_types") or [SLIDING if i >= start else FULL for i in range(n)])


def _num_experts(raw: dict) -> int:
    """num_experts (Qwen3-MoE, OLMoE checkpoints) or num_local_experts (Mixtral; transformers 5 saves all so)."""
    return raw.get("num_experts") or raw.get("num_local_experts") or 0


def _moe_fields(raw: dict, num_experts: int, intermediate: int, renormalize: bool, sparse: list[bool]) -> dict:
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": raw["num_experts_per_tok"],
        "moe_intermediate_size": intermediate,
        "norm_topk_prob": renormalize,
        "layer_moe": sparse,
    }


def llama(raw: dict, head_dim: int) -> dict:
    return {"o_bias": raw.get("attention_bias", False), "mlp_bias": raw.get("mlp_bias", False)}


def qwen2(raw: dict, head_dim: int) -> dict:
    return {"qkv_bias": True, "layer_sliding_windows": _qwen_windows(raw)}


def qwen3(raw: dict, head_dim: int) -> dict:
    return {"qk_norm": "head", "layer_sliding_windows": _qwen_windows(raw), "o_bias": raw.get("attention_bias", False)}


def mistral(raw: dict, head_dim: int) -> dict:
    """Mistral, Mixtral and Phi-3: every layer slides when sliding_window is set."""
    return {"layer_sliding_windows": _every_layer(raw, raw.get("sliding_window"))}


def smollm3(raw: dict, head_dim: int) -> dict:
    """Every no_rope_layer_interval-th layer has no rotary embedding (no_rope_layers[i] == 0)."""
    n, interval = raw["num_hidden_layers"], raw.get("no_rope_layer_interval", 4)
    uses_rope = raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)]
    slides = raw.get("use_sliding_window", False) and raw.get("sliding_window") is not None
    types = raw.get("layer_types") or [SLIDING if slides and not r else FULL for r in uses_rope]
    return {
        "layer_ropes": [rope_config(raw, head_dim) if r else None for r in uses_rope],
        "layer_sliding_windows": _by_layer_type(raw, types) if raw.get("use_sliding_window") else [None] * n,
        "o_bias": raw.get("attention_bias", False),
        "mlp_bias": raw.get("mlp_bias", False),
        "tie_word_embeddings": raw.get("tie_word_embeddings", True),
    }


def _gemma_types(raw: dict, pattern: int) -> list[str]:
    return raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(raw["num_hidden_layers"])]


def _gemma(raw: dict, types: list[str], final_softcap: float | None) -> dict:
    return {
        "hidden_act": raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh",
        "attn_scale": raw.get("query_pre_attn_scalar", 256) ** -0.5,
        "norm_offset": 1.0,
        "sandwich_norms": True,
        "embed_scale": raw["hidden_size"] ** 0.5,
        "final_softcap": raw.get("final_logit_softcapping", final_softcap),
        "layer_sliding_windows": _by_layer_type(raw, types),
        "o_bias": raw.get("attention_bias", False),
        "qkv_bias": raw.get("attention_bias", False),
        "tie_word_embeddings": raw.get("tie_word_embeddings", True),
    }


def gemma2(raw: dict, head_dim: int) -> dict:
    return {**_gemma(raw, _gemma_types(raw, 2), 30.0), "attn_softcap": raw.get("attn_logit_softcapping", 50.0)}


def gemma3(raw: dict, head_dim: int) -> dict:
    """Local and global layers rotate with tables of their own; attention is not soft-capped (as in transformers,
    which does not pass attn_logit_softcapping to Gemma 3's attention)."""
    types = _gemma_types(raw, raw.get("sliding_window_pattern", 6))
    ropes = layer_type_ropes(raw, head_dim, {FULL: 1_000_000.0, SLIDING: 10_000.0})
    return {**_gemma(raw, types, None), "qk_norm": "head", "layer_ropes": [ropes[t] for t in types]}


def qwen3_moe(raw: dict, head_dim: int) -> dict:
    n, step, dense = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1), raw.get("mlp_only_layers") or []
    experts = _num_experts(raw)
    sparse = [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)]
    window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
    return {
        **qwen3(raw, head_dim),
        **_moe_fields(raw, experts, raw["moe_intermediate_size"], raw.get("norm_topk_prob", False), sparse),
        "layer_sliding_windows": _every_layer(raw, window),
    }


def mixtral(raw: dict, head_dim: int) -> dict:
    sparse = _every_layer(raw, True)
    return {**mistral(raw, head_dim), **_moe_fields(raw, _num_experts(raw), raw["intermediate_size"], True, sparse)}


def olmoe(raw: dict, head_dim: int) -> dict:
    """q and k normed over the whole projection (all heads), optional clipping of q, k and v."""
    sparse = _every_layer(raw, True)
    renormalize = raw.get("norm_topk_prob", False)
    return {
        **_moe_fields(raw, _num_experts(raw), raw["intermediate_size"], renormalize, sparse),
        "qk_norm": "all",
        "clip_qkv": raw.get("clip_qkv"),
        "o_bias": raw.get("attention_bias", False),
        "qkv_bias": raw.get("attention_bias", False),
    }


FAMILIES = {  # architecture -> its reader
    "LlamaForCausalLM": llama,
    "Qwen2ForCausalLM": qwen2,
    "Qwen3ForCausalLM": qwen3,
    "MistralForCausalLM": mistral,
    "Phi3ForCausalLM": mistral,
    "SmolLM3ForCausalLM": smollm3,
    "Gemma2ForCausalLM": gemma2,
    "Gemma3ForCausalLM": gemma3,
    "Qwen3MoeForCausalLM": qwen3_moe,
    "MixtralForCausalLM": mixtral,
    "OlmoeForCausalLM": olmoe,
}

