"""Tensor parallel size 2 (two processes, gloo) gives transformers' greedy tokens for every natively served family:
heads, KV heads, MLP widths and experts' intermediate dims split over the ranks. One pair of processes serves all
the families in turn (each spawn imports torch anew)."""

import multiprocessing as mp
import queue
import socket

import pytest
import torch

from protocol.config import engine_config
from tests.worker.family_support import FAMILY_SPECS, build_family
from tests.worker.harness import Driver, hf_greedy, kv_config
from tests.worker.parity_support import MAX_NEW, RAGGED
from worker.worker import Worker

pytest.importorskip("transformers")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, folders: dict[str, str], port: int, results) -> None:
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
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, folders, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got: dict[tuple[int, str], tuple[int, list]] = {}
        while len(got) < 2 * len(folders):
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
            try:
                rank, name, kv_heads, tokens = results.get(timeout=1)
                got[rank, name] = (kv_heads, tokens)
            except queue.Empty:
                pass
        return got
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()


def test_tp2_matches_transformers_for_every_family(tmp_path):
    folders = {name: str(build_family(name, tmp_path / name)) for name in FAMILY_SPECS}
    got = run_tp2(folders)
    for name, folder in folders.items():
        expected = hf_greedy(folder, RAGGED, MAX_NEW)
        assert got[0, name] == (1, expected), name  # 2 KV heads split over 2 ranks
        assert got[1, name] == (1, expected), name  # rank 1 keeps the same token history (broadcast)
