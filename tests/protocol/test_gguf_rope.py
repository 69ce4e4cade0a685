"""Llama 3.1's rope scaling read back from the rope_freqs tensor llama.cpp writes for it: the derived parameters
give transformers' llama3 inverse frequencies of the original config; a tensor of another shape is refused."""

import pytest
import torch

from protocol.model.gguf_rope import llama3_scaling
from tests.protocol.gguf_rope_freqs import llama3_rope_freqs
from worker.model.rope import default_inv_freq, llama3_inv_freq

transformers = pytest.importorskip("transformers")

RELEASES = {  # head size, base, rope parameters of Llama 3.1 8B and Llama 3.2 1B, and a small model's
    "llama3.1-8b": (128, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}),
    "llama3.2-1b": (64, 500000.0, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
    "small": (32, 10000.0, {"factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                            "original_max_position_embeddings": 256}),
}


def hf_inv_freq(head_dim: int, theta: float, rope: dict) -> torch.Tensor:
    config = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                      rope_parameters={"rope_type": "llama3", "rope_theta": theta, **rope})
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"]
    inv_freq, attention_factor = init(config, "cpu")
    assert attention_factor == 1.0
    return inv_freq


@pytest.mark.parametrize("name", list(RELEASES))
def test_rope_freqs_give_transformers_llama3_frequencies(name):
    head_dim, theta, rope = RELEASES[name]
    scaling = llama3_scaling(llama3_rope_freqs(rope, theta, head_dim).tolist(), theta, head_dim)
    assert scaling is not None and scaling["rope_type"] == "llama3" and scaling["factor"] == rope["factor"]
    ours = llama3_inv_freq(default_inv_freq(theta, head_dim), scaling, scaling["original_max_position_embeddings"])
    torch.testing.assert_close(ours, hf_inv_freq(head_dim, theta, rope), rtol=1e-5, atol=0)
    if rope["low_freq_factor"] == 1.0:  # the scale L, low and high share is fixed by low = 1: Llama 3's own values
        assert scaling["original_max_position_embeddings"] == rope["original_max_position_embeddings"]
        assert scaling["high_freq_factor"] == pytest.approx(rope["high_freq_factor"], rel=1e-4)


def test_rope_freqs_of_ones_is_no_scaling():
    assert llama3_scaling([1.0] * 16, 10000.0, 32) is None


@pytest.mark.parametrize("divisors", [
    [1.0] * 8 + [1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 8.0],  # a ramp not linear in 1 / wavelength
    [1.0] * 10 + [2.0] + [8.0] * 5,  # one point between: the parameters cannot be told
])
def test_rope_freqs_of_another_shape_are_refused_by_name(divisors):
    with pytest.raises(ValueError, match="rope_freqs"):
        llama3_scaling(divisors, 10000.0, 32)
