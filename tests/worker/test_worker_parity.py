"""Greedy tokens of the paged-cache worker equal transformers' generate (float32, CPU, tiny random models)."""

import pytest
import torch

from protocol.config import engine_config
from tests.worker.harness import Driver, hf_greedy, kv_config
from tests.worker.parity_support import BACKENDS, BF16_LOGIT_TOL, FAMILIES, MAX_NEW, RAGGED, make_worker, prompts
from worker.kv_state import padded_num_tokens
from worker.model.tiny import write_model
from worker.worker import Worker

pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(folder, HF greedy outputs of RAGGED)."""
    spec = dict(FAMILIES[request.param])
    folder = write_model(tmp_path_factory.mktemp(request.param), spec.pop("architecture"), eos_token_id=None, **spec)
    return folder, hf_greedy(folder, RAGGED, MAX_NEW)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


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
    w.runner.kv.pad_tokens = True
    assert Driver(w, cfg, chunk=7).run(RAGGED, MAX_NEW) == expected


@pytest.mark.parametrize(("n", "padded"), [(1, 1), (3, 4), (8, 8), (9, 16), (64, 64), (65, 80), (256, 256),
                                           (257, 384), (2048, 2048)])
def test_padded_num_tokens_is_a_small_set_of_sizes(n, padded):
    assert padded_num_tokens(n) == padded
