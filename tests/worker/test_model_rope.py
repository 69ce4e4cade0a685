"""Rotary tables of every rope type against transformers' rotary embeddings on the same config: cos and sin at a
position p equal transformers' for a sequence of p + 1 tokens (its decode step at p), also past the original
context, where dynamic and longrope change their frequencies."""

import json

import pytest
import torch

from protocol.model.config import ModelConfig
from worker.model.rope import Rotary

transformers = pytest.importorskip("transformers")

HEAD_DIM, MAX_POS = 32, 64
RAW = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 128, "intermediate_size": 64,
       "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": HEAD_DIM,
       "max_position_embeddings": MAX_POS}
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 16},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}
POSITIONS = [0, 5, 15, 16, 40, 63, 80, 127]  # within and past original contexts of 16 (yarn, llama3) and 64


def hf_cos_sin(rotary, position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin at `position` in a forward over positions 0..position."""
    x = torch.zeros(1, position + 1, HEAD_DIM)
    cos, sin = rotary(x, torch.arange(position + 1).unsqueeze(0))
    return cos[0, -1], sin[0, -1]


def check_table(ours: Rotary, make_hf) -> None:
    for p in POSITIONS:
        cos, sin = hf_cos_sin(make_hf(), p)  # a fresh module: dynamic rope keeps state across calls
        torch.testing.assert_close(ours.cos[p, : cos.shape[0]], cos, rtol=1e-5, atol=1e-6, msg=f"cos at {p}")
        torch.testing.assert_close(ours.sin[p, : sin.shape[0]], sin, rtol=1e-5, atol=1e-6, msg=f"sin at {p}")


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_tables_match_transformers(kind):
    raw = {**RAW, "rope_parameters": {**SCALINGS[kind], "rope_theta": 10000.0}}
    rope = ModelConfig.from_dict(json.loads(json.dumps(raw))).layer_ropes[0]
    assert rope is not None and rope.rope_type == kind
    hf_config = transformers.LlamaConfig(**{k: v for k, v in raw.items() if k != "architectures"})
    check_table(Rotary(rope, 128, "cpu"),
                lambda: transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config))


def test_longrope_with_partial_rotary_matches_transformers():
    """Phi-4-mini's form: a quarter of each head unrotated, short factors up to the original context, long past it,
    cos and sin scaled by the attention factor; the v4 keys (rope_scaling of type 'su', top-level
    original_max_position_embeddings and partial_rotary_factor)."""
    factors = {"short_factor": [1.0 + 0.1 * i for i in range(12)], "long_factor": [2.0 + 0.2 * i for i in range(12)]}
    raw = {**RAW, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 128,
           "original_max_position_embeddings": 32, "partial_rotary_factor": 0.75, "rope_theta": 10000.0,
           "rope_scaling": {"type": "su", **factors}}
    rope = ModelConfig.from_dict(raw).layer_ropes[0]
    assert rope is not None and rope.rope_type == "longrope" and rope.rotary_dim == 24
    hf_config = transformers.Phi3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "head_dim")})
    check_table(Rotary(rope, 128, "cpu"), lambda: transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_config))


def test_partial_rotary_leaves_the_other_dims_alone():
    raw = {**RAW, "partial_rotary_factor": 0.5}
    rope = ModelConfig.from_dict(raw).layer_ropes[0]
    assert rope is not None and rope.rotary_dim == 16
    rotary = Rotary(rope, 16, "cpu")
    q, k = torch.randn(3, 4, HEAD_DIM), torch.randn(3, 2, HEAD_DIM)
    rq, rk = rotary.apply(q.clone(), k.clone(), torch.tensor([1, 5, 9]))
    assert torch.equal(rq[..., 16:], q[..., 16:]) and torch.equal(rk[..., 16:], k[..., 16:])
    assert not torch.equal(rq[..., :16], q[..., :16])
