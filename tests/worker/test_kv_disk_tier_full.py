"""The disk tier on a file system that really fills up (a small tmpfs, mounted by the test): a save that does not
fit makes room by dropping the tier's oldest blocks, or fails with one warning and the block stays in memory; the
tokens always equal those of an engine without the tier, nothing raises, and the tier works again once there is
room. A quantized KV cache (codes and scales) round-trips through the tier."""

import logging

import pytest

from engine_core.core import EngineCore
from tests.worker.kv_disk_support import (
    BLOCK,
    PREFIX,
    block_files,
    fill,
    make_engine,
    run,
    served_once,
    small_filesystem,
)

PROMPTS = {"a": PREFIX + [5, 6, 7], "b": [9] * (8 * BLOCK + 1), "c": [(i * 11) % 500 + 1 for i in range(5 * BLOCK)]}


def without_tier(tmp_path, prompts: dict[str, list[int]], **settings) -> dict[str, list[int]]:
    engine = make_engine(tmp_path, kv_disk_path=None, **settings)
    try:
        return run(engine, prompts)[0]
    finally:
        engine.shutdown()


def one_by_one(engine: EngineCore, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    return {rid: run(engine, {rid: prompt})[0][rid] for rid, prompt in prompts.items()}


def no_errors(caplog) -> bool:
    return not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_full_file_system_drops_old_blocks_to_make_room(tmp_path, caplog):
    expected = without_tier(tmp_path / "none", PROMPTS)
    with small_filesystem(tmp_path / "fs", "512k") as fs, caplog.at_level(logging.WARNING):
        engine = make_engine(fs, kv_disk_bytes=1 << 30)  # the bound is not what stops it: the file system is
        try:
            tokens = one_by_one(engine, PROMPTS)
            (tier,) = engine.get_tier_stats()
        finally:
            engine.shutdown()
        assert tokens == expected
        assert "is full" in caplog.text and no_errors(caplog)
        assert tier.removed_blocks > 0 and tier.saved_blocks > tier.removed_blocks
        held = block_files(fs)
        assert len(held) == tier.saved_blocks - tier.removed_blocks
        again, cached, _ = served_once(fs, {"c": PROMPTS["c"]}, kv_disk_bytes=1 << 30)  # a restart on the full disk
    assert again["c"] == expected["c"] and cached["c"] > 0  # the newest blocks were kept


def test_a_disk_another_program_filled_fails_saves_with_one_warning(tmp_path, caplog):
    expected = without_tier(tmp_path / "none", PROMPTS)
    with small_filesystem(tmp_path / "fs", "512k") as fs:
        engine = make_engine(fs, kv_disk_bytes=1 << 30)
        try:
            filler = fill(fs)
            with caplog.at_level(logging.WARNING):
                tokens = one_by_one(engine, {"a": PROMPTS["a"], "b": PROMPTS["b"]})
            (full,) = engine.get_tier_stats()
            assert full.saved_blocks == 0 and not block_files(fs)
            assert caplog.text.count("cannot write a block") == 1 and no_errors(caplog)
            filler.unlink()
            tokens.update(one_by_one(engine, {"c": PROMPTS["c"]}))
            (tier,) = engine.get_tier_stats()
        finally:
            engine.shutdown()
    assert tokens == expected
    assert tier.saved_blocks == 5  # room again: c's full blocks are saved


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_a_quantized_cache_round_trips_through_the_tier(tmp_path, kv_cache_dtype):
    """Codes and scales go to disk and come back: after a restart the prefix loads, with the tokens of an engine
    that computes it (the same quantized cache, no tier)."""
    prompts = {"a": PREFIX + [5, 6, 7]}
    expected = without_tier(tmp_path / "none", prompts, kv_cache_dtype=kv_cache_dtype)
    first, _, _ = served_once(tmp_path / "tier", prompts, kv_cache_dtype=kv_cache_dtype)
    again, cached, tier = served_once(tmp_path / "tier", prompts, kv_cache_dtype=kv_cache_dtype)
    assert first == again == expected
    assert cached == {"a": 6 * BLOCK} and tier.loaded_blocks == 6 and tier.failed_blocks == 0
    served_once(tmp_path / "tier", prompts)  # the float32 cache's blocks live under another fingerprint
    assert len([p for p in (tmp_path / "tier").iterdir() if p.is_dir()]) == 2
