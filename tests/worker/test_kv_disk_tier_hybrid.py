"""The disk tier on a model with sliding-window layers (a tiny Qwen2, window 24, sliding and full layers in turn:
two KV cache groups). Every group's blocks are saved; a hit loads the full-attention group's blocks and only the
sliding group's blocks in the window of the hit's end, and the sliding blocks the load skipped never join the
memory prefix cache (a later request that hits them would read garbage): the tokens always equal those of an
engine without the tier."""

from pathlib import Path

import pytest

from engine_core.core import EngineCore
from protocol.kv_store.index import BlockIndex
from tests.worker.kv_disk_support import BLOCK, PREFIX, make_engine, run, tier_dir
from worker.model.tiny import write_model

WINDOW = 24  # the sliding window: the hit's last cdiv(23, 16) = 2 blocks of the sliding group load
PROMPTS = {"a": PREFIX + [5, 6, 7], "b": PREFIX[: 3 * BLOCK] + [1, 2]}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("hybrid")
    return str(write_model(folder, "Qwen2ForCausalLM", use_sliding_window=True, sliding_window=WINDOW,
                           layer_types=["sliding_attention", "full_attention"] * 2))


def engine_on(path: Path | None, model: str) -> EngineCore:
    return make_engine(path or Path("unused"), model=model, kv_disk_path=None if path is None else str(path))


def one_by_one(engine: EngineCore, prompts: dict[str, list[int]]):
    tokens, cached = {}, {}
    for rid, prompt in prompts.items():
        t, c = run(engine, {rid: prompt})
        tokens[rid], cached[rid] = t[rid], c[rid]
    return tokens, cached


def served(path: Path | None, model: str, prompts: dict[str, list[int]]):
    engine = engine_on(path, model)
    try:
        tokens, cached = one_by_one(engine, prompts)
        windows = None if path is None else engine.scheduler.kv_connector.windows
        tier = None if path is None else engine.scheduler.kv_connector.stats()
    finally:
        engine.shutdown()
    return tokens, cached, tier, windows


def test_a_restart_loads_the_full_group_and_the_window(tmp_path, model):
    expected, _, _, _ = served(None, model, PROMPTS)
    first, _, _, windows = served(tmp_path, model, {"a": PROMPTS["a"]})
    assert sorted(windows, key=str) == [WINDOW, None]  # two groups: sliding and full
    again, cached, tier, _ = served(tmp_path, model, PROMPTS)
    assert first["a"] == again["a"] == expected["a"]
    assert again["b"] == expected["b"]  # had a's load registered the sliding blocks it skipped, b would hit them
    assert cached["a"] == 6 * BLOCK and tier.loaded_blocks == 6 + 2 + 3 + 2  # a: 6 full + 2 in the window
    assert cached["b"] == 3 * BLOCK  # so b loads its 3 blocks (and their window) from disk


def test_a_missing_window_block_shortens_the_hit(tmp_path, model):
    expected, _, _, _ = served(None, model, {"a": PROMPTS["a"]})
    _, _, _, windows = served(tmp_path, model, {"a": PROMPTS["a"]})
    sliding = windows.index(WINDOW)
    index = BlockIndex(str(tier_dir(tmp_path) / "index.sqlite"))
    try:  # a's blocks of the sliding group, in the order they were saved: block 5 is the last
        rows = index.db.execute("SELECT key FROM blocks ORDER BY ctime").fetchall()
    finally:
        index.close()
    keys = [key for (key,) in rows if int.from_bytes(key[-4:], "big") == sliding]
    assert len(keys) == 6
    name = keys[5].hex()
    (tier_dir(tmp_path) / "blocks" / name[:2] / f"{name}.kv").unlink()
    again, cached, tier, _ = served(tmp_path, model, {"a": PROMPTS["a"]})
    assert again["a"] == expected["a"]
    assert cached["a"] == 5 * BLOCK  # the hit ends where its window is whole: blocks 3 and 4
    assert tier.loaded_blocks == 5 + 2 and tier.failed_blocks == 0
