"""KV budget arithmetic with injected numbers; the smallest rank decides the block count."""

import pytest

from engine_core.kv_cache.planning import get_kv_cache_config
from protocol import FullAttentionSpec, SlidingWindowSpec
from worker import memory
from worker.worker import Worker

GIB = 1 << 30


def test_cuda_formula():
    b = memory.cuda_budget(total=80 * GIB, utilization=0.9, weights=16 * GIB, peak_activation=2 * GIB, non_torch=GIB)
    assert b.available_bytes == int(80 * GIB * 0.9) - 19 * GIB
    for term in (
        "total 80.00 GiB",
        "gpu_memory_utilization 0.9",
        "weights 16.00",
        "peak activation 2.00",
        "non-torch 1.00",
    ):
        assert term in b.detail


def test_cpu_default_share_and_explicit_budget():
    assert memory.cpu_budget(8 * GIB).available_bytes == int(8 * GIB * memory.CPU_DEFAULT_SHARE)
    assert "of available RAM" in memory.cpu_budget(8 * GIB).detail
    assert memory.explicit_budget(12345).available_bytes == 12345


def test_budget_below_one_block_names_the_terms():
    b = memory.cuda_budget(total=10 * GIB, utilization=0.5, weights=4 * GIB, peak_activation=GIB, non_torch=0)
    with pytest.raises(MemoryError, match="weights 4.00 GiB.*peak activation 1.00 GiB"):
        memory.check_fits_one_block(b, bytes_per_block=1 << 20)


def test_bytes_per_block_groups_like_the_planner():
    full, slide = FullAttentionSpec(16, 2, 64, 2), SlidingWindowSpec(16, 2, 64, 2, sliding_window=128)
    assert memory.bytes_per_block([full] * 4) == 4 * full.page_size_bytes
    assert memory.bytes_per_block([full] * 4 + [slide] * 2) == 2 * full.page_size_bytes


def test_worker_refuses_a_budget_without_room_for_one_block():
    with pytest.raises(MemoryError, match="one block needs 65536 bytes"):
        Worker(kv_cache_memory_bytes=1000).report_kv()  # 4 layers x 4 heads x 16 x 64 x 4 bytes


def test_ranks_with_different_budgets_the_smaller_wins():
    reports = [Worker(kv_cache_memory_bytes=b, max_model_len=64).report_kv() for b in (40 << 20, 10 << 20)]
    cfg = get_kv_cache_config(reports[0].kv_cache_specs, [r.available_kv_bytes for r in reports], 64, 64)
    assert cfg.num_blocks == (10 << 20) // 65536


def test_profile_forward_runs_on_a_scratch_cache(tmp_path):
    """The CUDA profile's forward (max_num_batched_tokens tokens, requests of max_model_len) on CPU, hybrid model."""
    from worker.model.tiny import write_model

    folder = write_model(tmp_path, "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=24, max_window_layers=2)
    w = Worker(model=str(folder), max_model_len=96, max_num_batched_tokens=200, kv_cache_memory_bytes=1 << 24)
    w.profile_run()  # 96 + 96 + 8 tokens
    assert w.runner.requests == {}
