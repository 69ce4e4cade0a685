"""config.json parsing: both rope forms, sliding layers decided exactly as transformers decides them, each family's
own fields, and what is refused."""

import pytest

from protocol.model.config import ModelConfig, UnsupportedArchitecture
from protocol.model.source import tiny_config
from tests.worker.family_support import raw_config_of

transformers = pytest.importorskip("transformers")

QWEN2_VARIANTS = [
    {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 0},
    {"use_sliding_window": False, "sliding_window": 24, "max_window_layers": 2},
    {"use_sliding_window": True, "sliding_window": 24, "layer_types": ["sliding_attention", "full_attention"] * 2},
]


@pytest.mark.parametrize("variant", QWEN2_VARIANTS)
def test_sliding_layers_match_transformers(variant):
    raw = tiny_config("Qwen2ForCausalLM", **variant)
    hf = transformers.Qwen2Config(**{k: v for k, v in raw.items() if k != "architectures"})
    expected = [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    assert ModelConfig.from_dict(raw).layer_sliding_windows == expected


def test_rope_theta_at_top_level_or_in_rope_parameters():
    top = ModelConfig.from_dict(tiny_config(rope_theta=5e5)).layer_ropes[0]
    nested = ModelConfig.from_dict(
        tiny_config(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    ).layer_ropes[0]
    assert top == nested and top is not None and top.theta == 5e5 and top.rope_type == "default"


def test_scaling_from_rope_scaling_and_unknown_types_refused():
    scaling = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192
    }
    rope = ModelConfig.from_dict(tiny_config(rope_scaling=scaling)).layer_ropes[0]
    assert rope is not None and rope.rope_type == "llama3" and rope.params["factor"] == 8.0
    with pytest.raises(ValueError, match="unsupported rope type 'mrope'"):
        ModelConfig.from_dict(tiny_config(rope_scaling={"rope_type": "mrope", "mrope_section": [8, 8]}))
    with pytest.raises(ValueError, match="rope type 'yarn' needs factor"):
        ModelConfig.from_dict(tiny_config(rope_scaling={"rope_type": "yarn"}))


def test_gemma3_rope_per_layer_type_in_either_form():
    """transformers 5 nests rope_parameters by layer type; 4 gives rope_theta, rope_local_base_freq, rope_scaling."""
    v5 = ModelConfig.from_dict(raw_config_of("gemma3"))
    v4_raw = {k: v for k, v in raw_config_of("gemma3").items() if k != "rope_parameters"}
    v4_raw.update(rope_theta=1e6, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0})
    v4 = ModelConfig.from_dict(v4_raw)
    assert v5.layer_ropes == v4.layer_ropes
    local, full = v5.layer_ropes[:2]
    assert local is not None and (local.rope_type, local.theta) == ("default", 10000.0)
    assert full is not None and (full.rope_type, full.theta, full.params["factor"]) == ("linear", 1e6, 8.0)
    assert v5.layer_sliding_windows == [24, None, 24, None] and v5.scale == 48**-0.5


def test_family_fields():
    gemma2, smollm3, olmoe = (ModelConfig.from_dict(raw_config_of(n)) for n in ("gemma2", "smollm3", "olmoe"))
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.norm_offset, gemma2.sandwich_norms) == (2.0, 8.0, 1, True)
    assert gemma2.embed_scale == 128**0.5 and gemma2.hidden_act == "gelu_pytorch_tanh"
    assert [r is not None for r in smollm3.layer_ropes] == [True, False, True, False]
    assert (olmoe.qk_norm, olmoe.clip_qkv, olmoe.num_experts, olmoe.norm_topk_prob) == ("all", 2.0, 8, False)


def test_qwen3_moe_dense_layers_and_either_expert_count_key():
    raw = raw_config_of("qwen3_moe")
    assert ModelConfig.from_dict(raw).layer_moe == [True, False, True, True]  # mlp_only_layers=[1]
    hub = {k: v for k, v in raw.items() if k != "num_local_experts"} | {"num_experts": 8, "decoder_sparse_step": 2}
    assert ModelConfig.from_dict(hub).layer_moe == [False, False, False, True]


def test_unsupported_architecture_is_refused():
    with pytest.raises(UnsupportedArchitecture, match="unsupported architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_dict(tiny_config("GPT2LMHeadModel"))


def test_tp_size_must_divide_the_experts_width():
    ModelConfig.from_dict(raw_config_of("qwen3_moe")).check_tp(2)
    cfg = ModelConfig.from_dict(raw_config_of("qwen3_moe") | {"moe_intermediate_size": 65})
    with pytest.raises(ValueError, match="does not divide the model's moe_intermediate_size 65"):
        cfg.check_tp(2)


def test_every_architecture_read_natively_has_a_native_implementation():
    from protocol.model.config import SUPPORTED_ARCHITECTURES
    from worker.model.registry import NATIVE

    assert set(NATIVE) == set(SUPPORTED_ARCHITECTURES)
