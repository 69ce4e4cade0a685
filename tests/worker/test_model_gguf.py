"""GGUF files beyond Llama's: Qwen2, Qwen3, Qwen3-MoE, Gemma 2 and 3, written here from transformers-built models
as llama.cpp's conversion writes them (its metadata keys and tensor names, Llama's Q/K rows interleaved, Gemma's
norms stored as 1 + weight, experts stacked, Llama 3.1's rope scaling as rope_freqs), load and give transformers'
greedy tokens of the original model."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from protocol.model.gguf_meta import ARCHITECTURES
from tests.protocol.gguf_rope_freqs import llama3_rope_freqs
from tests.worker.family_support import build_family
from tests.worker.harness import Driver, hf_greedy
from tests.worker.parity_support import MAX_NEW, RAGGED, make_worker
from worker.model.tiny import write_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

GGUF_ARCH = {v: k for k, v in ARCHITECTURES.items()}
NAMES = {  # HF name within a layer -> llama.cpp's
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}
GEMMA_NAMES = {**NAMES, "pre_feedforward_layernorm": "ffn_norm", "post_attention_layernorm": "post_attention_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}
EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K row order for Llama: each head's rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(tensors: dict[str, torch.Tensor], cfg: dict, arch: str) -> dict[str, np.ndarray]:
    gemma, out, experts = arch.startswith("gemma"), {}, {}
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    for name, t in tensors.items():
        data, stem, suffix = t.float().numpy(), *name.rsplit(".", 1)
        if stem in top:
            out[f"{top[stem]}.{suffix}"] = data + 1 if gemma and stem == "model.norm" else data
            continue
        _, _, layer, rest = stem.split(".", 3)
        if ".experts." in rest:
            e, proj = rest.split(".")[2:]
            experts.setdefault((layer, proj), {})[int(e)] = data
            continue
        kind = (GEMMA_NAMES if gemma else NAMES)[rest]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            data = interleave(data, cfg["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"])
        out[f"blk.{layer}.{kind}.{suffix}"] = data + 1 if gemma and kind.endswith("norm") else data
    for (layer, proj), by_expert in experts.items():
        out[f"blk.{layer}.{EXPERTS[proj]}.weight"] = np.stack([by_expert[e] for e in sorted(by_expert)])
    return out


def write_gguf(folder, path, add_vocab=None, qtypes: dict[str, str] | None = None) -> None:
    """add_vocab(writer): the tokenizer's keys (default: a placeholder vocabulary the worker does not read);
    qtypes: llama.cpp's tensor kind (attn_q, ffn_down, ..., token_embd, output) -> the GGUF type its weights are
    quantized to (Q8_0, Q4_0, Q4_1: the types the gguf package writes), float32 otherwise."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    w = gguf.GGUFWriter(str(path), arch)
    ints = {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
            "block_count": cfg["num_hidden_layers"], "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"],
            "attention.head_count_kv": cfg["num_key_value_heads"],
            "attention.key_length": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            "attention.sliding_window": cfg.get("sliding_window"), "expert_count": cfg.get("num_local_experts"),
            "expert_used_count": cfg.get("num_experts_per_tok"),
            "expert_feed_forward_length": cfg.get("moe_intermediate_size")}
    floats = {"attention.layer_norm_rms_epsilon": cfg["rms_norm_eps"],
              "rope.freq_base": (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta"),
              "attn_logit_softcapping": cfg.get("attn_logit_softcapping"),
              "final_logit_softcapping": cfg.get("final_logit_softcapping")}
    for key, value in ints.items():
        if value is not None:
            w.add_uint32(f"{arch}.{key}", value)
    for key, value in floats.items():
        if value is not None:
            w.add_float32(f"{arch}.{key}", value)
    if add_vocab is not None:
        add_vocab(w)
    else:
        w.add_string("tokenizer.ggml.model", "gpt2")
        w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(cfg["vocab_size"])])
    for name, data in gguf_tensors(load_file(str(folder / "model.safetensors")), cfg, arch).items():
        qtype = (qtypes or {}).get(name.split(".")[2] if name.startswith("blk.") else name.split(".")[0])
        if qtype is None:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
        else:
            raw = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data, dtype=np.float32), raw), raw_dtype=raw)
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":  # no rope scaling keys: llama.cpp keeps it as this tensor only
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, rope["rope_theta"], ints["attention.key_length"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# Gemma 3's file has no layer pattern or local rope base (llama.cpp fixes 1 in 6 global, base 10,000): six layers
GEMMA3 = {"num_hidden_layers": 6, "layer_types": ["sliding_attention"] * 5 + ["full_attention"], "head_dim": 48,
          "query_pre_attn_scalar": 48, "rope_parameters": {
              "full_attention": {"rope_type": "default", "rope_theta": 1e6},
              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}  # two frequencies on the ramp
CASES = {
    "llama": lambda folder: write_model(folder, eos_token_id=None),
    "llama3.1": lambda folder: write_model(folder, eos_token_id=None, rope_theta=None, rope_parameters=LLAMA31_ROPE),
    "qwen2": lambda folder: write_model(folder, "Qwen2ForCausalLM", eos_token_id=None),
    "qwen3": lambda folder: build_family("qwen3", folder, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen3_moe": lambda folder: build_family("qwen3_moe", folder, mlp_only_layers=[]),
    "gemma2": lambda folder: build_family("gemma2", folder, head_dim=48, query_pre_attn_scalar=48),
    "gemma3": lambda folder: build_family("gemma3", folder, **GEMMA3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_file_gives_transformers_greedy_tokens(name, tmp_path):
    folder = CASES[name](tmp_path / "hf")
    path = tmp_path / f"{name}.gguf"
    write_gguf(folder, path)
    w, cfg = make_worker(path, "cpu")
    assert Driver(w, cfg, chunk=16).run(RAGGED, MAX_NEW) == hf_greedy(folder, RAGGED, MAX_NEW)
