"""config.json parsing: both rope forms, and sliding layers decided exactly as transformers decides them."""

import pytest

from protocol.model.config import ModelConfig
from protocol.model.source import tiny_config

transformers = pytest.importorskip("transformers")

QWEN2_VARIANTS = [
    dict(use_sliding_window=True, sliding_window=24, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=24, max_window_layers=0),
    dict(use_sliding_window=False, sliding_window=24, max_window_layers=2),
    dict(use_sliding_window=True, sliding_window=24, layer_types=["sliding_attention", "full_attention"] * 2),
]


@pytest.mark.parametrize("variant", QWEN2_VARIANTS)
def test_sliding_layers_match_transformers(variant):
    raw = tiny_config("Qwen2ForCausalLM", **variant)
    hf = transformers.Qwen2Config(**{k: v for k, v in raw.items() if k != "architectures"})
    expected = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert ModelConfig.from_dict(raw).layer_sliding_windows == expected


def test_rope_theta_at_top_level_or_in_rope_parameters():
    top = ModelConfig.from_dict(tiny_config(rope_theta=5e5))
    nested = ModelConfig.from_dict(
        tiny_config(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    )
    assert top.rope_theta == nested.rope_theta == 5e5 and top.rope_scaling is None is nested.rope_scaling


def test_llama3_scaling_from_rope_scaling_and_unknown_types_refused():
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    assert ModelConfig.from_dict(tiny_config(rope_scaling=scaling)).rope_scaling["factor"] == 8.0
    with pytest.raises(ValueError, match="unsupported rope type 'yarn'"):
        ModelConfig.from_dict(tiny_config(rope_scaling=dict(rope_type="yarn", factor=4.0)))


def test_unsupported_architecture_is_refused():
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_dict(tiny_config("GPT2LMHeadModel"))
