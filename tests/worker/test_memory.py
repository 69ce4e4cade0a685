"""KV budget arithmetic with injected numbers; the smallest rank decides the block count."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_core.kv_cache.planning import get_kv_cache_config
from protocol.config import engine_config
from protocol.kv_cache_spec import KVCacheSizingError, check_fits_one_block
from worker import memory
from worker.worker import Worker

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10
TINY_BLOCK = 65536  # the built-in model: 4 layers x 4 KV heads x 16 tokens x (32 + 32) x 4 bytes


def test_cuda_formula():
    b = memory.cuda_budget(total=80 * GIB, utilization=0.9, weights=16 * GIB, peak_activation=2 * GIB, non_torch=GIB)
    assert b.available_bytes == int(80 * GIB * 0.9) - 19 * GIB
    assert b.detail == (
        "total 80 GiB x gpu_memory_utilization 0.9 - weights 16 GiB - peak activation 2 GiB - non-torch 1 GiB"
        " = 53 GiB for the KV cache"
    )


def test_cpu_default_is_room_for_max_num_seqs_requests_of_max_model_len():
    # 256 requests x 256 blocks of 64 KiB, plus the null block: 4 GiB + 64 KiB, under 25% of 24 GiB
    b = memory.cpu_budget(24 * GIB, max_num_seqs=256, max_model_len=4096, blocks_per_request=256, block_bytes=64 * KIB)
    assert b.available_bytes == (256 * 256 + 1) * 64 * KIB
    assert b.detail == (
        "CPU default: room for 256 requests of 4,096 tokens = 4 GiB (under the cap of 25% of available RAM, 6 GiB); "
        "RAM taken as blocks are first written, none zeroed at start-up"
    )


def test_cpu_default_is_capped_at_a_share_of_available_ram():
    b = memory.cpu_budget(8 * GIB, max_num_seqs=256, max_model_len=4096, blocks_per_request=256, block_bytes=64 * KIB)
    assert b.available_bytes == 2 * GIB == int(8 * GIB * memory.CPU_DEFAULT_SHARE)
    assert b.detail == (
        "CPU default: room for 256 requests of 4,096 tokens would need 4 GiB: capped at 25% of available RAM, 2 GiB; "
        "RAM taken as blocks are first written, none zeroed at start-up"
    )
    # Exactly at the cap: the room rule still decides.
    exact = memory.cpu_budget(4 * (3 * 10 + 1) * MIB, max_num_seqs=3, max_model_len=160, blocks_per_request=10,
                              block_bytes=MIB)
    assert exact.available_bytes == 31 * MIB and "under the cap" in exact.detail


def test_explicit_budget():
    b = memory.explicit_budget(12345)
    assert b.available_bytes == 12345
    assert b.detail == "--kv-cache-memory-bytes 12.1 KiB (profiling skipped)"


def test_budget_below_one_block_names_the_terms_in_readable_units():
    b = memory.cuda_budget(total=10 * GIB, utilization=0.5, weights=4 * GIB, peak_activation=GIB, non_torch=MIB)
    with pytest.raises(KVCacheSizingError) as err:
        check_fits_one_block(b.available_bytes, 2 * MIB, b.detail)
    message = str(err.value)
    assert message.startswith("No available memory for the cache blocks: one block needs 2 MiB but the KV cache "
                              "budget is -1 MiB (total 10 GiB x gpu_memory_utilization 0.5 - weights 4 GiB")
    assert "--gpu-memory-utilization" in message and "--kv-cache-memory-bytes" in message


def test_worker_refuses_a_budget_without_room_for_one_block():
    with pytest.raises(KVCacheSizingError, match="one block needs 64 KiB but the KV cache budget is 1000 B"):
        Worker(engine_config(kv_cache_memory_bytes=[1000], dtype="float32")).report_kv()


def test_worker_cpu_default_budget_follows_the_settings():
    report = Worker(engine_config(max_model_len=64, max_num_seqs=3, dtype="float32")).report_kv()
    assert report.available_kv_bytes == (3 * 64 // 16 + 1) * TINY_BLOCK  # 3 requests of 4 blocks + the null block
    assert report.memory_detail.startswith("CPU default: room for 3 requests of 64 tokens = 832 KiB (under the cap")


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="needs a torch build without CUDA")
def test_device_cuda_on_a_cpu_only_torch_is_one_clear_error():
    expected = (
        f"--device cuda: this torch build has no CUDA (torch {torch.__version__}); "
        "install a CUDA build of torch or use --device cpu"
    )
    with pytest.raises(ValueError) as err:
        Worker(engine_config(device="cuda"))
    assert str(err.value) == expected


def test_ranks_with_different_budgets_the_smaller_wins():
    reports = [Worker(engine_config(kv_cache_memory_bytes=[b], max_model_len=64, dtype="float32")).report_kv() for b in (40 << 20, 10 << 20)]
    cfg = get_kv_cache_config(reports[0].kv_cache_specs, [r.available_kv_bytes for r in reports], 64, 64)
    assert cfg.num_blocks == (10 << 20) // 65536


def test_profile_forward_runs_on_a_scratch_cache(tmp_path):
    """The CUDA profile's forward (max_num_batched_tokens tokens, requests of max_model_len) on CPU, hybrid model."""
    from worker.model.tiny import write_model

    folder = write_model(tmp_path, "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=24, max_window_layers=2)
    w = Worker(engine_config(model=str(folder), max_model_len=96, max_num_batched_tokens=200,
                             kv_cache_memory_bytes=[1 << 24]))
    w.profile_run()  # 96 + 96 + 8 tokens
    assert w.runner.requests == {}


def smaps_field(address: int, field: str) -> int:
    """A field (KiB) of the mapping that holds address, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == field:
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def resident_kib(address: int) -> int:
    """Rss of the mapping that holds address, from /proc/self/smaps."""
    return smaps_field(address, "Rss:")


def anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds address, from /proc/self/smaps."""
    return smaps_field(address, "AnonHugePages:")


def test_cpu_kv_tensor_takes_ram_only_as_blocks_are_written():
    """Start-up zeroes nothing: a 1 GiB cache costs no RAM until a block is written, then about that block's page."""
    shape = (2, 4, 8192, 16, 128)  # 1 GiB of fp32 blocks of 32 KiB (K and V of 4 heads)
    t = memory.cpu_zeros_huge_pages(shape, torch.float32)
    assert resident_kib(t.data_ptr()) <= 4096  # at most the huge pages at the mapping's unaligned ends
    t[:, :, 5000] = 1.0  # one block: 2 x 4 scattered 8 KiB pieces
    assert resident_kib(t.data_ptr()) <= 4096 + 8 * 2048
    assert t[:, :, 5000].eq(1.0).all() and not t[:, :, 4999].any() and not t[:, :, 5001].any()


def test_cpu_kv_tensor_is_zeroed_aligned_and_on_huge_pages():
    shape = (2, 4, 300, 16, 32)  # 4.7 MiB of bf16: at least one whole 2 MiB page
    t = memory.cpu_zeros_huge_pages(shape, torch.bfloat16)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % memory.HUGE_PAGE_BYTES == 0
    assert not t.any()
    t[0, 0, 0, 0, 0] = 1.5  # the first 2 MiB page lies whole inside the mapping: a huge page where THP allows
    t[1, 3, 299, 15, 31] = 2.5  # writable, to its last element
    assert t.sum().item() == 4.0
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        pytest.skip("no transparent huge pages on this kernel")
    if "[never]" in thp:
        pytest.skip("transparent huge pages are off on this machine")
    assert anon_huge_kib(t.data_ptr()) >= 2048


HUGE_PAGE_PROBE = """import torch
from tests.worker.test_memory import anon_huge_kib
t = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB through torch's CPU allocator, written
print(anon_huge_kib(t.data_ptr()))
"""


@pytest.mark.parametrize("device, preset, expected", [("cpu", None, "1"), ("cpu", "0", "0"), ("cuda", None, None)])
def test_worker_asks_torch_for_huge_pages_on_cpu(monkeypatch, device, preset, expected):
    """A CPU worker sets THP_MEM_ALLOC_ENABLE before torch starts, unless the environment already says; GPU ones not."""
    from worker.main import ask_for_huge_pages

    if preset is None:
        monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    else:
        monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", preset)
    ask_for_huge_pages(device)
    assert os.environ.get("THP_MEM_ALLOC_ENABLE") == expected


def test_torch_puts_large_allocations_on_huge_pages_when_asked():
    """What ask_for_huge_pages relies on: torch honours THP_MEM_ALLOC_ENABLE (a fresh process: it reads it once)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("transparent huge pages are off on this machine")

    def huge_kib(value: str) -> int:
        env = {**os.environ, "THP_MEM_ALLOC_ENABLE": value}
        out = subprocess.run([sys.executable, "-c", HUGE_PAGE_PROBE], env=env, capture_output=True, text=True,
                             check=True, cwd=Path(__file__).parents[2])
        return int(out.stdout.split()[-1])

    assert huge_kib("1") >= 32 * 1024  # most of the 64 MiB
    assert huge_kib("0") < huge_kib("1")
