"""`kvengine make-model --preset`: the config.json of a real model's shape, and the shape flags refused beside it."""

import argparse
import json

import pytest
import torch
import transformers

from launch.commands.make_model import add_make_model_parser, cmd_make_model, preset_overrides
from protocol.model.source import tiny_config


def parse(*argv: str) -> argparse.Namespace:
    sub = argparse.ArgumentParser().add_subparsers()
    add_make_model_parser(sub)
    return sub.choices["make-model"].parse_args(["out", *argv])


def parameters(cfg: dict) -> int:
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    return sum(p.numel() for p in model.parameters())


def test_smollm2_360m_shape():
    cfg = tiny_config("LlamaForCausalLM", **preset_overrides(parse("--preset", "smollm2-360m")))
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (960, 32, 15, 5, 2560, 49152, True)
    assert cfg["torch_dtype"] == "bfloat16"
    assert parameters(cfg) == 361_821_120  # SmolLM2-360M's count


def test_llama_3_2_1b_shape():
    cfg = tiny_config("LlamaForCausalLM", **preset_overrides(parse("--preset", "llama-3.2-1b")))
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (2048, 16, 32, 8, 8192, 128256, True)
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert parameters(cfg) == 1_235_814_400  # Llama-3.2-1B's count


@pytest.mark.parametrize("flag", [["--num-layers", "3"], ["--tie-word-embeddings"], ["--architecture", "llama"]])
def test_shape_flags_refused_beside_a_preset(flag, tmp_path, capsys):
    args = parse("--preset", "smollm2-360m", *flag)
    args.folder = str(tmp_path / "m")
    assert cmd_make_model(args) == 2
    assert flag[0] in capsys.readouterr().err
    assert not (tmp_path / "m").exists()


def test_without_a_preset_the_tiny_defaults_and_flags(tmp_path):
    args = parse("--num-layers", "2", "--dtype", "bfloat16")
    args.folder = str(tmp_path / "m")
    assert cmd_make_model(args) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"], cfg["torch_dtype"]) == (2, 256, 1024, "bfloat16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
