"""The built-in tiny model: deterministic random weights, made on the fly or written as an HF folder."""

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from protocol.model.source import tiny_config


def random_weights(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named weights in the config's torch_dtype; scaled so logits have clear winners (greedy parity is robust)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    hd = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads") or heads
    bias = cfg["architectures"][0] == "Qwen2ForCausalLM" or cfg.get("attention_bias", False)

    dtype = getattr(torch, cfg.get("torch_dtype", "float32"))

    def rand(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    w = {"model.embed_tokens.weight": rand(vocab, h, std=1.0), "model.norm.weight": 1 + rand(h, std=0.1)}
    if not cfg.get("tie_word_embeddings", False):
        w["lm_head.weight"] = rand(vocab, h, std=h**-0.5 * 4)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes = {
            "self_attn.q_proj": (heads * hd, h),
            "self_attn.k_proj": (kv * hd, h),
            "self_attn.v_proj": (kv * hd, h),
            "self_attn.o_proj": (h, heads * hd),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }
        for name, shape in shapes.items():
            w[f"{p}.{name}.weight"] = rand(*shape, std=shape[1] ** -0.5)
        if bias:
            for name in ("q_proj", "k_proj", "v_proj"):
                w[f"{p}.self_attn.{name}.bias"] = rand(shapes[f"self_attn.{name}"][0], std=0.1)
        w[f"{p}.input_layernorm.weight"] = 1 + rand(h, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1 + rand(h, std=0.1)
    return w


def write_model(folder: str | Path, architecture: str = "LlamaForCausalLM", seed: int = 0, **overrides) -> Path:
    """Write config.json + model.safetensors; backs `kvengine make-model`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_config(architecture, **overrides)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in random_weights(cfg, seed).items()}, str(folder / "model.safetensors"))
    return folder
