"""The transformers fallback (--model-impl transformers) gives transformers' greedy tokens for architectures kvengine
has no native implementation of (GPT-2: learned positions, LayerNorm; Granite: scaled embeddings, residuals,
attention and logits; Cohere 2: alternating sliding and global layers, scaled logits) and for one it has (Gemma 2:
soft-capping), where it also equals the native path; a ragged batch, a chunked prefill and the engine core with
preemption and prefix hits. And how --model-impl chooses, and what it refuses."""

import logging
from types import SimpleNamespace

import pytest
import torch

from protocol.config import engine_config
from tests.worker.family_support import build_family, randomize
from tests.worker.harness import Driver, hf_greedy
from tests.worker.parity_support import MAX_NEW, RAGGED, make_worker, preempting_waves
from worker.model.transformers_backend import _STEP, Step, TransformersModel, paged_attention_interface
from worker.worker import Worker

transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 1024, "hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": None, "pad_token_id": None}
NON_NATIVE = {
    "gpt2": ("GPT2Config", {"n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 256, "vocab_size": 1024,
                            "bos_token_id": 1, "eos_token_id": None}),
    "granite": ("GraniteConfig", {**SMALL, "intermediate_size": 256, "num_key_value_heads": 2,
                                  "embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.1, "logits_scaling": 4.0}),
    "cohere2": ("Cohere2Config", {**SMALL, "intermediate_size": 256, "num_key_value_heads": 2, "sliding_window": 24,
                                  "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention",
                                                  "full_attention"], "logit_scale": 0.5}),
}

# Pools small enough to preempt: Gemma 2's requests hold blocks in two groups, Cohere 2's in four (3 sliding
# layers and 1 global: a group per layer)
POOL = {"gemma2": 13, "cohere2": 36}


def build_non_native(name: str, folder):
    cls_name, kwargs = NON_NATIVE[name]
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**kwargs))
    randomize(model)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=[*NON_NATIVE, "gemma2"])
def fallback(request, tmp_path_factory):
    """(name, folder, HF greedy outputs of RAGGED)."""
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "gemma2":
        build_family("gemma2", folder)
    else:
        build_non_native(request.param, folder)
    return request.param, folder, hf_greedy(folder, RAGGED, MAX_NEW)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_ragged_batch_and_chunked_prefill_match_transformers(fallback, backend):
    name, folder, expected = fallback
    for chunk in (1 << 30, 7):
        w, cfg = make_worker(folder, backend, model_impl="transformers")
        assert isinstance(w.model, TransformersModel)
        assert Driver(w, cfg, chunk=chunk).run(RAGGED, MAX_NEW) == expected, f"chunk {chunk}"
    if name == "gemma2":  # and the native path gives the same
        w, cfg = make_worker(folder, backend, model_impl="native")
        assert not isinstance(w.model, TransformersModel)
        assert Driver(w, cfg).run(RAGGED, MAX_NEW) == expected


def test_engine_with_preemption_and_prefix_cache_matches_transformers(fallback):
    name, folder, _ = fallback
    asked, got, stats = preempting_waves(folder, POOL.get(name, 12), model_impl="transformers")
    assert got == hf_greedy(folder, asked, MAX_NEW)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_auto_prefers_native_and_says_which_serves(tmp_path, caplog):
    native, other = build_family("qwen3", tmp_path / "qwen3"), build_non_native("gpt2", tmp_path / "gpt2")
    with caplog.at_level(logging.INFO, logger="worker.model.loader"):
        assert not isinstance(Worker(engine_config(model=str(native))).model, TransformersModel)
        assert isinstance(Worker(engine_config(model=str(other))).model, TransformersModel)
    assert "Qwen3ForCausalLM is served by kvengine's native implementation" in caplog.text
    assert "GPT2LMHeadModel is served by the transformers fallback" in caplog.text


def test_what_the_fallback_refuses(tmp_path, monkeypatch):
    gpt2 = build_non_native("gpt2", tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*--model-impl transformers"):
        Worker(engine_config(model=str(gpt2), model_impl="native"))
    with pytest.raises(ValueError, match="tensor parallel size 1, not 2"):
        Worker(engine_config(model=str(gpt2), tensor_parallel_size=2), dist_init_method="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="serves a Hugging Face folder, not the built-in model"):
        Worker(engine_config(model_impl="transformers"))
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'kvengine\[transformers\]'"):
        Worker(engine_config(model=str(gpt2)))


@pytest.mark.parametrize(("change", "error"), [
    ({"sliding_window": 8}, "attends over a window of 8 tokens but its KV cache spec says None"),
    ({"attention_mask": torch.zeros(1, 1, 3, 3)}, "causal, without an attention mask"),
    ({"s_aux": torch.zeros(4)}, "has no s_aux"),
    ({"head_dim": 16}, "has 2 KV heads of 16 dims, but the KV cache spec gives every layer 2 of 32"),
])
def test_the_attention_call_refuses_what_the_paged_cache_cannot_do(change, error):
    """Refused, never ignored: a window other than the spec's, a mask, sinks, a head size of another layer."""
    module = SimpleNamespace(layer_idx=0, is_causal=True)
    hd = change.pop("head_dim", 32)
    query, key = torch.zeros(1, 4, 3, 32), torch.zeros(1, 2, 3, hd)
    token = _STEP.set(Step([None], [None], None, 3, [None], 2, 32))  # type: ignore[arg-type]
    try:
        with pytest.raises(ValueError, match=error):
            paged_attention_interface(module, query, key, key, change.pop("attention_mask", None), **change)
    finally:
        _STEP.reset(token)
