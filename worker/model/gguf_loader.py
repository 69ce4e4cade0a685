"""GGUF checkpoints (optional extra `gguf`): config from metadata, weights renamed to the Hugging Face names, undoing
what llama.cpp's conversion changed (Llama's interleaved Q/K rows, Gemma's norm weights stored with their 1 added,
MoE experts stacked in one tensor); Llama 3.1's rope_freqs is read as the rope scaling of the config, not as a
weight. The linear layers', the embedding's and the LM head's Q8_0, Q4_0, Q4_1 and Q4_K weights stay as their
blocks (worker/model/gguf_quant.py); everything else, and everything with keep_quantized False, is dequantised to
float32 at load."""

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from protocol.model.gguf_meta import field, gguf_config, open_gguf
from worker.model.gguf_quant import KEPT, GGUFQuantTensor

log = logging.getLogger(__name__)

_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GEMMA_NAMES = {  # Gemma's four norms a layer
    **_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LINEAR = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", *_EXPERTS}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of the rotary halves in Q/K rows (back to rotate-half order)."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(name: str, data: np.ndarray, cfg: dict, arch: str) -> dict[str, np.ndarray]:
    """One GGUF tensor as the HF tensors it holds (several for stacked experts)."""
    parts = name.split(".")
    gemma = arch.startswith("gemma")
    if parts[0] == "rope_freqs":
        return {}  # Llama 3.1's rope scaling, which gguf_config has read from it
    if parts[0] != "blk":
        if parts[0] not in _TOP:
            raise ValueError(f"GGUF tensor {name!r} has no counterpart here")
        return {f"{_TOP[parts[0]]}.{parts[-1]}": data - 1 if gemma and parts[0] == "output_norm" else data}
    layer, kind, suffix = parts[1], parts[2], parts[-1]
    prefix = f"model.layers.{layer}"
    if kind in _EXPERTS:
        return {f"{prefix}.mlp.experts.{e}.{_EXPERTS[kind]}.{suffix}": data[e] for e in range(data.shape[0])}
    if arch == "llama" and kind in ("attn_q", "attn_k"):
        data = _unpermute(data, cfg["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"])
    names = _GEMMA_NAMES if gemma else _NAMES
    if kind not in names:
        raise ValueError(f"GGUF tensor {name!r} has no counterpart in a {arch} model here")
    if gemma and kind.endswith("norm"):
        data = data - 1  # llama.cpp stores Gemma's norm weights as 1 + weight
    return {f"{prefix}.{names[kind]}.{suffix}": data}


def load_gguf(path: str | Path,
              keep_quantized: bool = True) -> tuple[dict, dict[str, torch.Tensor | GGUFQuantTensor]]:
    """Config and weights. A quantized embedding is kept too: the LM head multiplies it as it is, the embedding
    lookup reads it dequantized (WeightSource.read)."""
    gguf, reader = open_gguf(path)
    cfg = gguf_config(reader)
    arch = field(reader, "general.architecture")
    weights: dict[str, torch.Tensor | GGUFQuantTensor] = {}
    kept: dict[str, Counter[str]] = {}
    dense: dict[str, Counter[str]] = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if keep_quantized and _kept(t.name, qtype):
            kept.setdefault(qtype, Counter())[_kind(t.name)] += 1
            for name, value in hf_tensors(t.name, np.asarray(t.data), cfg, arch).items():
                weights[name] = GGUFQuantTensor(name, qtype, np.ascontiguousarray(value))
            continue
        dense.setdefault(qtype, Counter())[_kind(t.name)] += 1
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        for name, value in hf_tensors(t.name, data, cfg, arch).items():
            weights[name] = torch.from_numpy(np.ascontiguousarray(value))
    log.info("%s: tensors that stay quantized: %s; dequantized at load: %s", Path(path).name, _counts(kept),
             _counts(dense))
    return cfg, weights


def _kept(name: str, qtype: str) -> bool:
    """A linear layer's weight, the embedding or the LM head, in a format the kernels read."""
    parts = name.split(".")
    return qtype in KEPT and (parts[0] in ("token_embd", "output") or parts[0] == "blk" and parts[2] in _LINEAR)


def _kind(name: str) -> str:
    """A tensor's kind without its layer: blk.3.ffn_down.weight -> ffn_down.weight."""
    parts = name.split(".")
    return ".".join(parts[2:] if parts[0] == "blk" else parts)


def _counts(by_type: dict[str, Counter[str]]) -> str:
    """Q4_1 210 (attn_q.weight 30, ...); F32 61 (...)."""
    return "; ".join(f"{qtype} {kinds.total()} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})"
                     for qtype, kinds in sorted(by_type.items())) or "none"
