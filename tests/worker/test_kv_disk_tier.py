"""The disk tier (--kv-disk-path) with the real EngineCore and an in-process worker on the built-in model in
float32: a prefix computed by one engine is loaded from disk by the next (a restart) with the same tokens; a
corrupt, truncated or missing block is a miss there and the rest is computed; blocks of another fingerprint are
never read; --preemption-mode swap gives recompute's tokens while computing fewer prompt tokens."""

import logging
import os
from pathlib import Path

import pytest

from engine_core.core import EngineCore
from protocol import EngineCoreRequest, SamplingParams
from protocol.kv_store.index import BlockIndex
from tests.worker.kv_disk_support import BLOCK, GREEDY, PREFIX, block_files, make_engine, run, served_once, tier_dir


def test_a_restart_loads_the_prefix_from_disk_with_the_same_tokens(tmp_path):
    prompts = {"a": PREFIX + [5, 6, 7]}
    first, cached, tier = served_once(tmp_path, prompts)
    assert cached == {"a": 0} and tier.saved_blocks == 6 and tier.hits == 0
    assert len(block_files(tmp_path)) == 6
    again, cached, tier = served_once(tmp_path, {"a": PREFIX + [5, 6, 7], "b": PREFIX[:40] + [1, 2]})
    assert again["a"] == first["a"]
    assert cached == {"a": 6 * BLOCK, "b": 2 * BLOCK}  # b's two blocks: loaded by a, or by b itself
    assert tier.loaded_blocks >= 6 and tier.failed_blocks == 0
    assert tier.saved_blocks == 1  # b's third block (its last prompt tokens and outputs) is new
    computed, _, _ = served_once(tmp_path / "other", {"b": PREFIX[:40] + [1, 2]})
    assert again["b"] == computed["b"]


def test_corrupt_truncated_and_missing_blocks_are_misses_with_the_right_tokens(tmp_path, caplog):
    prompts = {"a": PREFIX + [5, 6, 7]}
    first, _, _ = served_once(tmp_path, prompts)
    index = BlockIndex(str(tier_dir(tmp_path) / "index.sqlite"))
    keys = [bytes.fromhex(f.stem) for f in block_files(tmp_path)]
    order = sorted(keys, key=lambda k: PREFIX_ORDER(index, k))
    index.close()
    files = {k: next(f for f in block_files(tmp_path) if f.stem == k.hex()) for k in keys}
    for case, damage in (("corrupt", _flip_a_payload_byte), ("truncated", _truncate), ("missing", os.remove)):
        target = files[order[3]]
        damage(target)
        with caplog.at_level(logging.WARNING):
            again, cached, tier = served_once(tmp_path, prompts)
        assert again == first, case
        assert cached == {"a": 3 * BLOCK}, case  # the three blocks before the damaged one
        assert tier.loaded_blocks == 3, case
        if case != "missing":  # found when read (a missing file's entry already left the index at start)
            assert tier.failed_blocks == 1 and "KV disk tier" in caplog.text, case
        caplog.clear()
        assert target.exists(), "the block was computed again and saved again"


def PREFIX_ORDER(index: BlockIndex, key: bytes) -> float:
    """Blocks of one request are saved in order: their save times order them."""
    return index.db.execute("SELECT ctime FROM blocks WHERE key = ?", (key,)).fetchone()[0]


def _flip_a_payload_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_blocks_of_another_fingerprint_are_never_read(tmp_path):
    prompts = {"a": PREFIX + [5, 6, 7]}
    served_once(tmp_path, prompts)
    _, cached, tier = served_once(tmp_path, prompts, block_size=32)  # another KV layout: another folder
    assert cached == {"a": 0} and tier.loaded_blocks == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2


def test_an_abort_while_loading_frees_the_blocks_once_the_load_ends(tmp_path):
    served_once(tmp_path, {"a": PREFIX + [5, 6, 7]})
    engine = make_engine(tmp_path)
    try:
        engine.add_request(EngineCoreRequest("a", PREFIX + [5, 6, 7], GREEDY, 0.0))
        scheduler = engine.scheduler
        so = scheduler.schedule()  # admitted to load: its blocks go to the worker with the load
        assert "a" in scheduler.tier_loads.requests and so.kv_connector_metadata.loads
        engine.abort_requests(["a"])
        outputs = scheduler.update_from_output(so, engine.executor.execute_model(so))
        while engine.has_work():
            outputs += engine.step().outputs
        assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs] == [("a", "abort", [])]
        pool = engine.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 and not engine.scheduler.requests
    finally:
        engine.shutdown()


def test_a_bounded_tier_evicts_to_its_size(tmp_path):
    _, _, tier = served_once(tmp_path, {"a": PREFIX + [5, 6, 7]})
    size = sum(f.stat().st_size for f in block_files(tmp_path)) // 6
    _, _, tier = served_once(tmp_path, {"b": [9] * (8 * BLOCK + 1)}, kv_disk_bytes=4 * size)
    assert tier.removed_blocks > 0
    assert sum(f.stat().st_size for f in block_files(tmp_path)) <= 4 * size
    assert len(block_files(tmp_path)) == 4


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swap_gives_recompute_tokens_and_computes_fewer_prompt_tokens(tmp_path, async_scheduling):
    prompts = {f"r{i}": [(i * 131 + j * 7) % 1000 + 1 for j in range(70 + 9 * i)] for i in range(5)}
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for mode in ("recompute", "swap"):
        engine = make_engine(tmp_path / mode, preemption_mode=mode, num_gpu_blocks_override=24,
                             async_scheduling=async_scheduling)
        counted = _count_prompt_tokens(engine)
        try:
            tokens, _ = run(engine, prompts, params)
            results[mode] = (tokens, counted[0], engine.get_stats().num_preemptions,
                             engine.scheduler.kv_connector.stats().hits)
        finally:
            engine.shutdown()
    (rec_tokens, rec_computed, rec_preempted, _), (swap_tokens, swap_computed, swap_preempted, swap_hits) = (
        results["recompute"], results["swap"])
    assert rec_preempted > 0 and swap_preempted > 0
    assert swap_tokens == rec_tokens
    assert swap_hits > 0 and swap_computed < rec_computed


def _count_prompt_tokens(engine: EngineCore) -> list[int]:
    """Counts, as the scheduler commits them, scheduled tokens that were already known (prompt, or outputs computed
    again): the work a preemption costs."""
    counted = [0]
    scheduler = engine.scheduler
    update = scheduler._update_after_schedule

    def counting(scheduled, num_scheduled_tokens):
        for r in scheduled:
            counted[0] += max(0, min(num_scheduled_tokens[r.request_id], len(r.all_token_ids) - r.num_computed_tokens))
        update(scheduled, num_scheduled_tokens)

    scheduler._update_after_schedule = counting
    return counted
