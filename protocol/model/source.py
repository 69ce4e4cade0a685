"""A model's config.json dict from whatever `--model` names: the built-in tiny model, an HF folder or a GGUF file."""

import json
from pathlib import Path

from protocol.model.gguf_meta import gguf_config, open_gguf

TINY_DEFAULTS = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 1024,
}


def tiny_config(architecture: str = "LlamaForCausalLM", **overrides) -> dict:
    """A config.json dict (transformers 4 form: rope_theta at the top level)."""
    cfg = dict(
        architectures=[architecture],
        model_type="qwen2" if architecture == "Qwen2ForCausalLM" else "llama",
        **TINY_DEFAULTS,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    cfg.update(overrides)
    return cfg


def read_config(folder: str | Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def raw_config(model: str | None) -> dict:
    """The HF-style config dict of --model (None: the built-in tiny model)."""
    if model is None:
        return tiny_config()
    if model.endswith(".gguf"):
        return gguf_config(open_gguf(model)[1])
    return read_config(model)
