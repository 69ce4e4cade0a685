"""Small random-weight models of each natively served family, built by transformers from the family's own config
class and saved as HF folders (no tests in here).

transformers initialises weights with std 0.02, which leaves logits nearly tied; `randomize` redraws them so
greedy decoding has clear winners (as worker/model/tiny.py does), and so that MoE routers pick distinct experts.
"""

from pathlib import Path

import torch

WINDOW = 24
# realistic ratios at a small size: 4 query heads over 2 KV heads of 32 dims (64 for Gemma), a few layers
BASE = {"vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": None,
        "pad_token_id": None}
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 128,
            "short_factor": [1.0 + 0.05 * i for i in range(12)], "long_factor": [1.5 + 0.1 * i for i in range(12)]}
FAMILY_SPECS: dict[str, tuple[str, dict]] = {
    # q/k RMS norm per head; YaRN rope (position-independent, so it holds at any length)
    "qwen3": ("Qwen3Config", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                  "original_max_position_embeddings": 32}}),
    # Llama plus a sliding window on every layer
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    # fused qkv and gate-up weights, a quarter of each head not rotated (Phi-4-mini), LongRoPE
    "phi3": ("Phi3Config", {"head_dim": None, "partial_rotary_factor": 0.75, "rope_parameters": LONGROPE,
                            "original_max_position_embeddings": 128, "pad_token_id": None}),
    # every second layer without rope
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2}),
    # alternating local (windowed) and global layers, attention and logit soft-capping, a query scale of its own
    "gemma2": ("Gemma2Config", {"head_dim": 64, "sliding_window": WINDOW, "attn_logit_softcapping": 2.0,
                                "final_logit_softcapping": 8.0, "query_pre_attn_scalar": 48,
                                "hidden_activation": "gelu_pytorch_tanh"}),
    # local layers with rope base 10k, global ones with 1M and linear scaling; q/k norms
    "gemma3": ("Gemma3TextConfig", {"head_dim": 64, "sliding_window": WINDOW, "query_pre_attn_scalar": 48,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2,
                                    "rope_parameters": {
                                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    # 8 experts, top 2 renormalised; layer 1 dense
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                     "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64}),
    # q/k norms over the whole projection, q/k/v clipped, top-2 not renormalised
    "olmoe": ("OlmoeConfig", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
                              "clip_qkv": 2.0}),
}


def config_of(name: str, **changes):
    import transformers

    cls_name, overrides = FAMILY_SPECS[name]
    kwargs = {**BASE, **overrides, **changes}
    if kwargs["head_dim"] is None:
        del kwargs["head_dim"]
    return getattr(transformers, cls_name)(**kwargs)


def raw_config_of(name: str) -> dict:
    """The family's config.json dict, as save_pretrained writes it (with its architectures)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = config_of(name)
    return {**config.to_dict(), "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]}


def randomize(model: torch.nn.Module, seed: int = 0, norm_offset: float = 0.0) -> None:
    """Weights drawn as worker/model/tiny.py draws them: matrices with std fan_in^-0.5, embeddings 1.0, the LM
    head 4 x hidden^-0.5, norms 1 + N(0, 0.1) (N(0, 0.1) where the model adds the 1 itself), biases N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g)
            if p.dim() == 1:
                p.copy_((0.0 if "bias" in name else 1.0 - norm_offset) + 0.1 * noise)
            elif "embed" in name or "wte" in name or "wpe" in name:
                p.copy_(noise)
            elif "lm_head" in name:
                p.copy_(noise * 4 * p.shape[-1] ** -0.5)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)


def build_family(name: str, folder: Path, seed: int = 0, **changes) -> Path:
    """The family's model (its spec with `changes` to the config), random weights, saved to folder."""
    from transformers import AutoModelForCausalLM

    config = config_of(name, **changes)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed, norm_offset=1.0 if name.startswith("gemma") else 0.0)
    model.save_pretrained(folder)
    return folder
