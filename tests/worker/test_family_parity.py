"""Every natively served family (tests/worker/family_support.py) gives transformers' greedy tokens (float32, CPU):
a ragged batch and a chunked prefill on both attention backends, a second wave over cached prefix blocks, and the
real engine core with a pool small enough to preempt."""

import pytest
import torch

from protocol.config import engine_config
from tests.worker.family_support import FAMILY_SPECS, build_family
from tests.worker.harness import Driver, hf_greedy, kv_config
from tests.worker.parity_support import BACKENDS, MAX_NEW, RAGGED, make_worker, preempting_waves, prompts
from worker.worker import Worker

pytest.importorskip("transformers")

# Pools small enough to preempt: local and global layers hold blocks in two groups; where every layer slides
# (Mistral) a request holds at most the window's blocks.
NUM_BLOCKS = {"gemma2": 13, "gemma3": 13, "mistral": 8}


@pytest.fixture(scope="module", params=list(FAMILY_SPECS))
def family(request, tmp_path_factory):
    """(name, folder, HF greedy outputs of RAGGED)."""
    folder = build_family(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, folder, hf_greedy(folder, RAGGED, MAX_NEW)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_and_chunked_prefill_match_transformers(family, backend):
    _, folder, expected = family
    for chunk in (1 << 30, 7):
        w, cfg = make_worker(folder, backend)
        assert Driver(w, cfg, chunk=chunk).run(RAGGED, MAX_NEW) == expected, f"chunk {chunk}"


def test_second_wave_on_cached_prefix_blocks_matches_transformers(family):
    _, folder, _ = family
    w, cfg = make_worker(folder, BACKENDS[0])
    driver = Driver(w, cfg)
    first = prompts([40, 75], seed=2)
    second = [first[0][:35] + [7, 8, 9], first[1] + [11] * 5]
    driver.run(first, 3)
    assert driver.run(second, MAX_NEW) == hf_greedy(folder, second, MAX_NEW)
    assert driver.num_prefix_hit_tokens >= 32 + 64


def test_engine_with_preemption_chunks_and_prefix_cache_matches_transformers(family):
    name, folder, _ = family
    asked, got, stats = preempting_waves(folder, NUM_BLOCKS.get(name, 12))
    assert got == hf_greedy(folder, asked, MAX_NEW)
    assert stats.num_preemptions > 0
    assert stats.prefix_cache_hits > 0


FEATURES = {  # family -> a config change that turns off what sets it apart
    "qwen3": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    "mistral": {"sliding_window": None},
    "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    "smollm3": {"no_rope_layer_interval": 100},
    "gemma2": {"attn_logit_softcapping": None},
    "gemma3": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "qwen3_moe": {"norm_topk_prob": False},
    "olmoe": {"clip_qkv": None},
}


@pytest.mark.parametrize("name", list(FEATURES))
def test_the_families_features_change_transformers_output(name, tmp_path):
    """The parity tests above would see a feature missing: the same weights without it generate differently."""
    plain = build_family(name, tmp_path / "plain", **FEATURES[name])
    assert hf_greedy(plain, RAGGED, MAX_NEW) != hf_greedy(build_family(name, tmp_path / "spec"), RAGGED, MAX_NEW)


def test_gemma2_final_logit_softcapping_matches_transformers(tmp_path):
    """The worker's logits of each prompt's first sampled token equal transformers' (soft-capped to (-8, 8))."""
    from transformers import AutoModelForCausalLM

    folder = build_family("gemma2", tmp_path)
    w = Worker(engine_config(model=str(folder), dtype="float32", max_model_len=256, kv_cache_memory_bytes=[1 << 26]))
    cfg = kv_config(w, 256)
    w.init_kv_cache(cfg)
    captured = []
    logits = w.model.logits
    w.model.logits = lambda h: captured.append(logits(h)) or captured[-1]
    Driver(w, cfg).run(RAGGED, 1)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in RAGGED])
    got = torch.cat(captured)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert got.abs().max() < 8.0 and expected.abs().max() > 4.0  # capped, and the cap bends them
