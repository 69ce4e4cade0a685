"""`kvengine make-model`: write the built-in model (or any size, or a named real model's shape) as a Hugging Face
folder with deterministic random weights."""

import argparse
import sys
from typing import Any

# Real models' shapes (their config.json fields), for benchmarks on real sizes without a download.
PRESETS: dict[str, dict] = {
    "smollm2-360m": {
        "hidden_size": 960, "num_hidden_layers": 32, "num_attention_heads": 15, "num_key_value_heads": 5,
        "head_dim": 64, "intermediate_size": 2560, "vocab_size": 49152, "tie_word_embeddings": True,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
    },
    "llama-3.2-1b": {
        "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
}
TINY: dict[str, Any] = {"architecture": "llama", "hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 4,
        "intermediate_size": 512, "vocab_size": 1024, "max_position_embeddings": 4096}


def add_make_model_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a model with deterministic random weights as an HF folder",
                       description="Writes config.json + model.safetensors. Defaults: the built-in tiny model "
                                   "(hidden 256, 4 layers, 8 heads / 4 KV heads, intermediate 512, vocab 1024).")
    p.add_argument("folder")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="a real model's shape (Llama architecture, bfloat16 weights); the shape flags are refused "
                        "beside it")
    p.add_argument("--architecture", choices=["llama", "qwen2"], help="default: llama")
    for flag in ("hidden-size", "num-layers", "num-heads", "num-kv-heads", "intermediate-size", "vocab-size",
                 "max-position-embeddings"):
        p.add_argument(f"--{flag}", type=int, help=f"default: {TINY[flag.replace('-', '_')]}")
    p.add_argument("--sliding-window", type=int, default=None,
                   help="qwen2 only: layers from --max-window-layers on attend to this many tokens")
    p.add_argument("--max-window-layers", type=int, default=None, help="qwen2: first layer index that slides")
    p.add_argument("--tie-word-embeddings", action="store_true", default=None)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the weights' dtype (default: float32; bfloat16 with --preset)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)


SHAPE_FLAGS = [*TINY, "sliding_window", "max_window_layers", "tie_word_embeddings"]


def preset_overrides(args: argparse.Namespace) -> dict:
    """The config fields of --preset; ValueError naming a shape flag given beside it."""
    given = [name for name in SHAPE_FLAGS if getattr(args, name) is not None]
    if given:
        raise ValueError(f"--preset {args.preset} fixes the shape: drop --{given[0].replace('_', '-')}")
    return {**PRESETS[args.preset], "torch_dtype": args.dtype or "bfloat16"}


def size_overrides(args: argparse.Namespace) -> dict:
    """The config fields of the shape flags; ValueError for --sliding-window without qwen2."""
    shape = {name: default if getattr(args, name) is None else getattr(args, name) for name, default in TINY.items()}
    overrides = {
        "hidden_size": shape["hidden_size"],
        "num_hidden_layers": shape["num_layers"],
        "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_kv_heads"],
        "intermediate_size": shape["intermediate_size"],
        "vocab_size": shape["vocab_size"],
        "max_position_embeddings": shape["max_position_embeddings"],
        "tie_word_embeddings": bool(args.tie_word_embeddings),
        "torch_dtype": args.dtype or "float32",
    }
    if args.sliding_window is not None:
        if shape["architecture"] != "qwen2":
            raise ValueError("--sliding-window needs --architecture qwen2")
        overrides.update(use_sliding_window=True, sliding_window=args.sliding_window,
                         max_window_layers=args.max_window_layers or shape["num_layers"] // 2)
    return overrides


def cmd_make_model(args: argparse.Namespace) -> int:
    from worker.model.tiny import write_model

    try:
        overrides = preset_overrides(args) if args.preset else size_overrides(args)
    except ValueError as e:
        print(f"kvengine make-model: {e}", file=sys.stderr)
        return 2
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[args.architecture or "llama"]
    folder = write_model(args.folder, architecture, args.seed, **overrides)
    print(f"wrote {folder}/config.json and {folder}/model.safetensors")
    return 0
