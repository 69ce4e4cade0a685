"""Greedy tokens of the paged-cache worker equal transformers' generate (float32, CPU, tiny random models)."""

import os

import pytest
import torch

from protocol.config import engine_config
from tests.worker.harness import Driver, hf_greedy, kv_config
from worker.model.tiny import write_model
from worker.model_runner import padded_num_tokens
from worker.worker import Worker

pytest.importorskip("transformers")

MAX_NEW = 10
WINDOW = 24
FAMILIES = {
    "llama": dict(architecture="LlamaForCausalLM"),
    # transformers 5 form: rope_theta inside rope_parameters, with Llama 3 scaling; tied head
    "llama3_tied": dict(
        architecture="LlamaForCausalLM",
        tie_word_embeddings=True,
        rope_theta=None,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        ),
    ),
    "qwen2_bias": dict(architecture="Qwen2ForCausalLM", rope_theta=1000000.0),
    # layers 2 and 3 slide (i >= max_window_layers), as transformers' Qwen2Config decides
    "qwen2_sliding": dict(
        architecture="Qwen2ForCausalLM", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
    ),
}


def prompts(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lengths]


RAGGED = prompts([3, 17, 40, 75])


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(folder, HF greedy outputs of RAGGED)."""
    spec = dict(FAMILIES[request.param])
    folder = write_model(tmp_path_factory.mktemp(request.param), spec.pop("architecture"), eos_token_id=None, **spec)
    return folder, hf_greedy(folder, RAGGED, MAX_NEW)


DEVICE = os.environ.get("KVENGINE_TEST_DEVICE", "cpu")  # bench/gpu_check.sh runs these on cuda
# The in-place C++ kernel is CPU-only; on CUDA both names resolve to the torch path.
BACKENDS = ["cpu", "torch"] if DEVICE == "cpu" else ["torch"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def make_worker(folder, backend, **kw):
    w = Worker(engine_config(
        attention_backend=backend,
        model=str(folder),
        device=DEVICE,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=[1 << 26],
        check_block_tables=True,
        **kw,
    ))
    assert w.runner.attention_backend == backend
    cfg = kv_config(w, 256)
    w.init_kv_cache(cfg)
    return w, cfg


def test_ragged_batch_matches_transformers(family, backend):
    folder, expected = family
    w, cfg = make_worker(folder, backend)
    assert Driver(w, cfg).run(RAGGED, MAX_NEW) == expected


def test_chunked_prefill_matches_transformers(family, backend):
    folder, expected = family
    w, cfg = make_worker(folder, backend)
    assert Driver(w, cfg, chunk=7).run(RAGGED, MAX_NEW) == expected


def test_second_wave_on_cached_prefix_blocks_matches_transformers(family, backend):
    folder, _ = family
    w, cfg = make_worker(folder, backend)
    driver = Driver(w, cfg)
    first = prompts([40, 75], seed=2)
    second = [first[0][:35] + [7, 8, 9], first[1] + [11] * 5, first[1][:64] + [5]]
    driver.run(first, 3)
    assert driver.run(second, MAX_NEW) == hf_greedy(folder, second, MAX_NEW)
    assert driver.num_prefix_hit_tokens >= 32 + 64 + 64


def test_sliding_window_changes_the_output(tmp_path, backend):
    """The window must really apply: the same weights without it generate differently."""
    spec = dict(FAMILIES["qwen2_sliding"])
    arch = spec.pop("architecture")
    slide = write_model(tmp_path / "slide", arch, eos_token_id=None, **spec)
    spec["use_sliding_window"] = False
    full = write_model(tmp_path / "full", arch, eos_token_id=None, **spec)
    long_prompts = prompts([75, 60], seed=3)
    outs = []
    for folder in (slide, full):
        w, cfg = make_worker(folder, backend)
        outs.append(Driver(w, cfg).run(long_prompts, MAX_NEW))
    assert outs[0] != outs[1]
    assert outs[0] == hf_greedy(slide, long_prompts, MAX_NEW)


BF16_LOGIT_TOL = 0.05  # of the logits' spread: bf16 weights, activations and KV cache; fp32 accumulation and norms


def test_bfloat16_logits_stay_within_tolerance_of_transformers_float32(family):
    """bf16 is not bit-equal to fp32, so greedy tokens may part at near ties: the stated tolerance is on the
    logits of every prompt's first sampled token, max |bf16 - fp32| at most BF16_LOGIT_TOL x their std."""
    from transformers import AutoModelForCausalLM

    folder, _ = family
    w = Worker(engine_config(model=str(folder), dtype="bfloat16", attention_backend="cpu", max_model_len=256,
                             kv_cache_memory_bytes=[1 << 26]))
    cfg = kv_config(w, 256)
    w.init_kv_cache(cfg)
    captured = []
    logits = w.model.logits
    w.model.logits = lambda h: captured.append(logits(h)) or captured[-1]
    Driver(w, cfg).run(RAGGED, 1)
    got = torch.cat(captured).float()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in RAGGED])
    error = (got - expected).abs().max() / expected.std()
    assert error <= BF16_LOGIT_TOL, float(error)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.75


def test_padded_steps_match_transformers(family, backend):
    """Padding a step's tokens to a bucket size (done for bf16 on CPU) must leave the real tokens' results alone:
    forced on in float32, greedy tokens stay exactly transformers'."""
    folder, expected = family
    w, cfg = make_worker(folder, backend)
    w.runner.pad_tokens = True
    assert Driver(w, cfg, chunk=7).run(RAGGED, MAX_NEW) == expected


@pytest.mark.parametrize(("n", "padded"), [(1, 1), (3, 4), (8, 8), (9, 16), (64, 64), (65, 80), (256, 256),
                                           (257, 384), (2048, 2048)])
def test_padded_num_tokens_is_a_small_set_of_sizes(n, padded):
    assert padded_num_tokens(n) == padded
