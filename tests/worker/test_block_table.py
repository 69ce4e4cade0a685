"""Block tables: overwrite, append, row reuse, vectorised slots, and the digest check."""

import pytest
import torch

from protocol import CachedRequestData, NewRequestData, SamplingParams, SchedulerOutput, block_ids_digest
from protocol.config import engine_config
from tests.worker.harness import kv_config
from worker.attention import StepRequests, build_metadata
from worker.block_table import BlockTableMismatch, BlockTables
from worker.worker import Worker


def test_overwrite_append_and_row_reuse():
    bt = BlockTables(num_groups=2, max_num_reqs=2, max_num_blocks_per_req=8)
    row_a = bt.add("a", [[1, 2], [5]])
    bt.append("a", [[3], []])
    assert bt.block_ids("a") == [[1, 2, 3], [5]]
    bt.add("a", [[7], [8, 9]])  # resumed after preemption: overwritten, same row
    assert bt.block_ids("a") == [[7], [8, 9]] and bt.rows["a"] == row_a
    row_b = bt.add("b", [[4], [6]])
    assert row_b != row_a
    with pytest.raises(RuntimeError, match="no free block table row"):
        bt.add("c", [[1], [1]])
    bt.free("a")
    assert bt.add("c", [[10, 11], [12]]) == row_a  # the freed row is reused, old ids gone
    assert bt.block_ids("c") == [[10, 11], [12]]


def test_row_overflow_is_refused():
    bt = BlockTables(1, 1, 2)
    bt.add("a", [[1, 2]])
    with pytest.raises(ValueError, match="needs 3 blocks"):
        bt.append("a", [[3]])


def test_verify_accepts_the_ledger_digest_and_rejects_another():
    bt = BlockTables(1, 4, 8)
    bt.add("a", [[3, 1, 4]])
    bt.verify("a", block_ids_digest([[3, 1, 4]]))
    with pytest.raises(BlockTableMismatch, match="'a'"):
        bt.verify("a", block_ids_digest([[3, 1, 5]]))


def test_slot_mapping_is_block_id_times_block_size_plus_offset():
    bs = 4
    table = torch.zeros(3, 5, dtype=torch.int32)
    table[0, :3] = torch.tensor([7, 2, 9])
    table[2, :2] = torch.tensor([5, 1])
    # request on row 0: 3 computed, 6 new (positions 3..8); request on row 2: decode at position 6
    counts = torch.tensor([6, 1])
    reqs = StepRequests(
        rows=torch.tensor([0, 2]),
        num_computed=torch.tensor([3, 6]),
        num_scheduled=counts,
        query_start=torch.tensor([0, 6]),
        positions=torch.tensor([3, 4, 5, 6, 7, 8, 6]),
        token_rows=torch.tensor([0] * 6 + [2]),
    )
    meta = build_metadata(table, bs, None, reqs, kv_bytes_per_token=64)
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4, 2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4, 1 * 4 + 2]


def _new(req_id, blocks):
    return NewRequestData(req_id, list(range(5, 25)), [], SamplingParams(temperature=0.0), blocks, 0)


def test_worker_fails_loudly_on_a_digest_mismatch():
    w = Worker(engine_config(max_model_len=64, kv_cache_memory_bytes=[1 << 24], check_block_tables=True))
    w.init_kv_cache(kv_config(w, 16))
    ok = SchedulerOutput(
        0,
        [_new("a", [[1, 2]])],
        CachedRequestData(),
        {"a": 20},
        20,
        block_table_digests={"a": block_ids_digest([[1, 2]])},
    )
    assert w.execute_model(ok).sampled_token_ids[0]
    # the ledger appended block 3, but the message lost it: the worker's table says [1, 2]
    bad = SchedulerOutput(
        1,
        [],
        CachedRequestData(["a"], [None], [20]),
        {"a": 1},
        1,
        block_table_digests={"a": block_ids_digest([[1, 2, 3]])},
    )
    with pytest.raises(BlockTableMismatch):
        w.execute_model(bad)


def test_check_mode_refuses_a_step_without_digests():
    w = Worker(engine_config(max_model_len=64, kv_cache_memory_bytes=[1 << 24], check_block_tables=True))
    w.init_kv_cache(kv_config(w, 16))
    with pytest.raises(BlockTableMismatch, match="without a digest"):
        w.execute_model(SchedulerOutput(0, [_new("a", [[1, 2]])], CachedRequestData(), {"a": 20}, 20))
