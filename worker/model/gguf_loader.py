"""GGUF Llama checkpoints (optional extra `gguf`): config from metadata, weights dequantised at load."""

from pathlib import Path

import numpy as np
import torch

from protocol.model.gguf_meta import gguf_config, open_gguf

_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in Q/K rows (back to rotate-half order)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    gguf, reader = open_gguf(path)
    cfg = gguf_config(reader)
    weights = {}
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        parts = t.name.split(".")
        if parts[0] == "blk":
            kind = parts[2]
            if kind == "attn_q":
                data = _unpermute(data, cfg["num_attention_heads"])
            elif kind == "attn_k":
                data = _unpermute(data, cfg["num_key_value_heads"])
            name = f"model.layers.{parts[1]}.{_NAMES[kind]}.weight"
        else:
            name = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}[parts[0]]
            name += ".weight"
        weights[name] = torch.from_numpy(np.ascontiguousarray(data))
    return cfg, weights
