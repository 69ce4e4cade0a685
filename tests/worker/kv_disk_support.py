"""Helpers of the disk tier's in-process tests: a real EngineCore and in-process worker on the built-in model in
float32, over a tier folder."""

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.config import engine_config
from worker.inproc_executor import InProcExecutor

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BLOCK = 16
PREFIX = [(i * 37) % 900 + 3 for i in range(6 * BLOCK + 5)]  # six full blocks and a bit


def make_engine(path: Path, **settings) -> EngineCore:
    config = engine_config(**{"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": [1 << 24],
                              "max_num_batched_tokens": 64, "kv_disk_path": str(path), "check_block_tables": True,
                              **settings})
    return EngineCore(config, InProcExecutor(config))


def run(engine: EngineCore, prompts: dict[str, list[int]], params: SamplingParams = GREEDY):
    """Tokens and cached prompt tokens per request."""
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    cached: dict[str, int] = {}
    for rid, prompt in prompts.items():
        engine.add_request(EngineCoreRequest(rid, prompt, params, 0.0))
    while engine.has_work():
        for out in engine.step().outputs:
            assert out.error is None, out.error
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                cached[out.request_id] = out.num_cached_tokens
    return tokens, cached


def served_once(path: Path, prompts: dict[str, list[int]], **settings):
    engine = make_engine(path, **settings)
    try:
        tokens, cached = run(engine, prompts)
        tier = engine.scheduler.kv_connector.stats()
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # every block back
    finally:
        engine.shutdown()
    return tokens, cached, tier


def tier_dir(path: Path) -> Path:
    (only,) = [p for p in path.iterdir() if p.is_dir()]
    return only


def block_files(path: Path) -> list[Path]:
    return sorted((tier_dir(path) / "blocks").rglob("*.kv"))


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at path (a file system that really fills up), unmounted afterwards; the test is
    skipped where this process may not mount (not root, or no CAP_SYS_ADMIN)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill(path: Path) -> Path:
    """Write a file in path until its file system is full."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    return filler
