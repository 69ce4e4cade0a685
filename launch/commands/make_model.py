"""`kvengine make-model`: write the built-in model (or any size) as a Hugging Face folder."""

import argparse
import sys


def add_make_model_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-model", help="write a model with deterministic random weights as an HF folder",
                       description="Writes config.json + model.safetensors. Defaults: the built-in tiny model "
                                   "(hidden 256, 4 layers, 8 heads / 4 KV heads, intermediate 512, vocab 1024).")
    p.add_argument("folder")
    p.add_argument("--architecture", choices=["llama", "qwen2"], default="llama")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--max-position-embeddings", type=int, default=4096)
    p.add_argument("--sliding-window", type=int, default=None,
                   help="qwen2 only: layers from --max-window-layers on attend to this many tokens")
    p.add_argument("--max-window-layers", type=int, default=None, help="qwen2: first layer index that slides")
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_model)


def cmd_make_model(args: argparse.Namespace) -> int:
    from worker.model.tiny import write_model

    overrides = {
        "hidden_size": args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "intermediate_size": args.intermediate_size,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": args.max_position_embeddings,
        "tie_word_embeddings": args.tie_word_embeddings,
    }
    if args.sliding_window is not None:
        if args.architecture != "qwen2":
            print("kvengine make-model: --sliding-window needs --architecture qwen2", file=sys.stderr)
            return 2
        overrides.update(use_sliding_window=True, sliding_window=args.sliding_window,
                         max_window_layers=args.max_window_layers or args.num_layers // 2)
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[args.architecture]
    folder = write_model(args.folder, architecture, args.seed, **overrides)
    print(f"wrote {folder}/config.json and {folder}/model.safetensors")
    return 0
