"""Open a GGUF file and read its metadata fields; no torch, so the client-side tokenizer can use it.

gguf_config turns llama.cpp's metadata into the config.json dict transformers would write for the same model, for
the architectures kvengine serves natively: llama (also Mistral's files), qwen2, qwen3, qwen3moe, gemma2, gemma3.
What llama.cpp fixes in code rather than in the file is filled in as llama.cpp does (Gemma 3's local rope base and
1-in-6 global layers, Gemma's query scale of the 27B sizes); Llama 3.1's rope scaling comes from its rope_freqs.
"""

from pathlib import Path

from protocol.model.gguf_rope import llama3_scaling, rope_freqs_divisors

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}  # these scale queries by hidden / heads, not the head size


def open_gguf(path: str | Path):
    """(the gguf module, a GGUFReader over path); a clear message when the optional extra is missing."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading a .gguf file needs the optional extra: pip install 'kvengine[gguf]'") from e
    return gguf, gguf.GGUFReader(str(path))


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> dict:
    """An HF-style config.json dict from the GGUF metadata."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")

    def meta(key: str, default=None):
        return field(reader, f"{arch}.{key}", default)

    heads, hidden = meta("attention.head_count"), meta("embedding_length")
    head_dim = meta("attention.key_length") or hidden // heads
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": meta("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": meta("context_length", 2048),
        "rope_theta": meta("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10000.0),
        "rope_scaling": _rope_scaling(reader, meta, head_dim),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "eos_token_id": eos,
    }
    if arch in _GEMMA_27B_LAYERS:
        cfg.update(_gemma(meta, cfg, arch))
    if arch == "qwen3moe":
        cfg.update(num_experts=meta("expert_count"), num_experts_per_tok=meta("expert_used_count"),
                   moe_intermediate_size=meta("expert_feed_forward_length"), norm_topk_prob=True)
    return cfg


def _rope_scaling(reader, meta, head_dim: int) -> dict | None:
    """From the rope.scaling keys, or for Llama 3.1 from the rope_freqs tensor (llama.cpp writes no key for it)."""
    kind, divisors = meta("rope.scaling.type"), rope_freqs_divisors(reader)
    if divisors is not None:
        if kind not in (None, "none"):
            raise ValueError(f"a GGUF file with both rope_freqs and {kind} rope scaling is not supported")
        theta = meta("rope.freq_base", 10000.0)
        return llama3_scaling(divisors, theta, meta("rope.dimension_count") or head_dim)
    if kind in (None, "none"):
        return None
    scaling = {"rope_type": kind, "factor": meta("rope.scaling.factor")}
    if meta("rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = meta("rope.scaling.original_context_length")
    return scaling


def _gemma(meta, cfg: dict, arch: str) -> dict:
    big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[arch]
    fields = {
        "sliding_window": meta("attention.sliding_window"),
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
    }
    if arch == "gemma2":
        fields["attn_logit_softcapping"] = meta("attn_logit_softcapping")
    else:
        fields.update(rope_local_base_freq=10000.0, sliding_window_pattern=6)
    return fields
