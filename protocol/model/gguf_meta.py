"""Open a GGUF file and read its metadata fields; no torch, so the client-side tokenizer can use it."""

from pathlib import Path


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
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; only llama")
    heads = field(reader, "llama.attention.head_count")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": field(reader, "llama.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        "hidden_size": field(reader, "llama.embedding_length"),
        "intermediate_size": field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": field(reader, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": field(reader, "llama.attention.head_count_kv", heads),
        "rms_norm_eps": field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "max_position_embeddings": field(reader, "llama.context_length", 2048),
        "rope_theta": field(reader, "llama.rope.freq_base", 10000.0),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "eos_token_id": eos,
    }
