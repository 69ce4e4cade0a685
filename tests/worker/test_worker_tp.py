"""Tensor parallel size 2 (two processes, gloo) gives transformers' greedy tokens; bad sizes are refused."""

import pytest
import torch

from protocol import SamplingParams
from protocol.config import engine_config
from protocol.model.config import ModelConfig
from protocol.model.source import tiny_config
from tests.worker.harness import Driver, hf_greedy, kv_config
from tests.worker.parity_support import FAMILIES, MAX_NEW, RAGGED
from tests.worker.rank_support import run_ranks
from worker.model.tiny import write_model
from worker.worker import Worker

pytest.importorskip("transformers")


def _rank_main(rank: int, port: int, results, folder: str, chunk: int, params: SamplingParams | None) -> None:
    torch.set_num_threads(1)
    config = engine_config(tensor_parallel_size=2, model=folder, max_model_len=256, dtype="float32",
                           kv_cache_memory_bytes=[1 << 26], check_block_tables=True)
    worker = Worker(config, rank, dist_init_method=f"tcp://127.0.0.1:{port}")
    try:
        report = worker.report_kv()
        cfg = kv_config(worker, 256)
        worker.init_kv_cache(cfg)
        results.put(
            (
                rank,
                report.kv_cache_specs["model.layers.0.self_attn"].num_kv_heads,
                Driver(worker, cfg, chunk).run(RAGGED, MAX_NEW, params),
            )
        )
    finally:
        worker.shutdown()


def run_tp2(folder, chunk: int = 1 << 30, params: SamplingParams | None = None) -> dict:
    got = run_ranks(_rank_main, (str(folder), chunk, params), 2)
    return {rank: (kv_heads, tokens) for rank, kv_heads, tokens in got}


@pytest.mark.parametrize("name", ["llama3_tied", "qwen2_sliding"])
def test_tp2_matches_transformers(name, tmp_path):
    spec = dict(FAMILIES[name])
    folder = write_model(tmp_path, spec.pop("architecture"), eos_token_id=None, **spec)
    got = run_tp2(folder, chunk=16)
    expected = hf_greedy(folder, RAGGED, MAX_NEW)
    assert got[0] == (2, expected)  # 4 KV heads split over 2 ranks
    assert got[1] == (2, expected)  # rank 1 keeps the same token history (broadcast)


def test_tp2_samples_with_controls_and_prompt_logprobs_as_one_rank(tmp_path):
    """The sampling controls run on rank 0 only; prompt log-probabilities take the LM head's gather on every rank."""
    folder = write_model(tmp_path, "LlamaForCausalLM", eos_token_id=None)
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={7: 4.0}, min_tokens=3,
                            prompt_logprobs=2, bad_words_token_ids=[[7, 7]])
    one = Worker(engine_config(model=str(folder), max_model_len=256, dtype="float32",
                               kv_cache_memory_bytes=[1 << 26], check_block_tables=True))
    cfg = kv_config(one, 256)
    one.init_kv_cache(cfg)
    expected = Driver(one, cfg, 16).run(RAGGED, MAX_NEW, params)
    assert run_tp2(folder, chunk=16, params=params) == {0: (2, expected), 1: (2, expected)}


def test_tp_size_that_does_not_divide_heads_is_refused(tmp_path):
    folder = write_model(tmp_path, num_attention_heads=6, num_key_value_heads=3, hidden_size=192)
    with pytest.raises(ValueError, match="tensor parallel size 2 does not divide the model's 3 KV heads"):
        Worker(engine_config(model=str(folder), tensor_parallel_size=2), dist_init_method="tcp://127.0.0.1:1")


def test_head_check_names_both_counts():
    cfg = ModelConfig.from_dict(tiny_config())
    with pytest.raises(ValueError, match="divides both 8 and 4"):
        cfg.check_tp(3)
