"""Tensor parallel size 2 (two processes, gloo) gives transformers' greedy tokens for every natively served family:
heads, KV heads, MLP widths and experts' intermediate dims split over the ranks. One pair of processes serves all
the families in turn (each spawn imports torch anew)."""

import pytest
import torch

from protocol.config import engine_config
from tests.worker.family_support import FAMILY_SPECS, build_family
from tests.worker.harness import Driver, hf_greedy, kv_config
from tests.worker.parity_support import MAX_NEW, RAGGED
from tests.worker.rank_support import run_ranks
from worker.worker import Worker

pytest.importorskip("transformers")


def _rank_main(rank: int, port: int, results, folders: dict[str, str]) -> None:
    torch.set_num_threads(1)
    init = f"tcp://127.0.0.1:{port}"
    for name, folder in folders.items():
        config = engine_config(tensor_parallel_size=2, model=folder, max_model_len=256, dtype="float32",
                               kv_cache_memory_bytes=[1 << 26], check_block_tables=True)
        worker = Worker(config, rank, dist_init_method=init)  # joins the process group once, for all families
        report = worker.report_kv()
        cfg = kv_config(worker, 256)
        worker.init_kv_cache(cfg)
        kv_heads = report.kv_cache_specs["model.layers.0.self_attn"].num_kv_heads
        results.put((rank, name, kv_heads, Driver(worker, cfg, chunk=16).run(RAGGED, MAX_NEW)))
    worker.shutdown()


def run_tp2(folders: dict[str, str]) -> dict[tuple[int, str], tuple[int, list]]:
    got = run_ranks(_rank_main, (folders,), 2 * len(folders))
    return {(rank, name): (kv_heads, tokens) for rank, name, kv_heads, tokens in got}


def test_tp2_matches_transformers_for_every_family(tmp_path):
    folders = {name: str(build_family(name, tmp_path / name)) for name in FAMILY_SPECS}
    got = run_tp2(folders)
    for name, folder in folders.items():
        expected = hf_greedy(folder, RAGGED, MAX_NEW)
        assert got[0, name] == (1, expected), name  # 2 KV heads split over 2 ranks
        assert got[1, name] == (1, expected), name  # rank 1 keeps the same token history (broadcast)
