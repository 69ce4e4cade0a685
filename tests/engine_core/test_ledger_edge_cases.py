"""The Chinese seed's list "邊界與失敗" (edges and failures), one test per entry, plus the English
seed's "Errors and edge cases" table where it is not covered elsewhere.

vLLM entry -> kvengine behaviour tested here:
1. get_new_blocks beyond the free count: ValueError; callers count first.
2. Hybrid does not support DCP / PCP: kvengine has no DCP/PCP knobs at all.
3. Unitary requires hash_block_size == block_size: request hashes must be made at the spec's block size.
4. Hybrid needs at least two attention (spec) groups.
5. Setting a hash on a block that already has one: assertion.
6. reset_prefix_cache refuses while blocks other than the null block are in use: warning + False.
7. evict_blocks with an out-of-range id from a KV connector: refused at once.
8. prefix-cache retention interval validation: not a kvengine feature.
"""

import logging
from typing import ClassVar

import pytest

from engine_core.kv_cache.block import KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.coordinator import (
    HybridKVCacheCoordinator,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from tests.engine_core.ledger_support import (
    admit,
    check_invariants,
    full_spec,
    make_config,
    make_manager,
    make_request,
    queue_ids,
    snapshot,
    swa_spec,
)


# 1 ------------------------------------------------------------------------------------------------
def test_get_new_blocks_beyond_free_raises_and_takes_nothing():
    pool = BlockPool(6, enable_caching=True)
    pool.get_new_blocks(3)
    queue_before = queue_ids(pool)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert queue_ids(pool) == queue_before == [4, 5]
    assert [b.ref_cnt for b in pool.blocks] == [0, 1, 1, 1, 0, 0]


def test_allocate_slots_counts_first_so_get_new_blocks_never_raises():
    mgr = make_manager(4, full_spec(4))  # 3 usable
    req = make_request("r", range(16), block_size=4)  # 4 blocks
    before = snapshot(mgr)
    assert mgr.allocate_slots(req, 16) is None  # not a ValueError from the pool
    assert snapshot(mgr) == before


# 3 ------------------------------------------------------------------------------------------------
def test_unitary_hashes_are_made_at_the_specs_block_size():
    mgr = make_manager(20, full_spec(4))
    assert isinstance(mgr.coordinator, UnitaryKVCacheCoordinator)
    req = make_request("r", range(18), block_size=4)
    assert len(req.block_hashes) == 18 // 4
    admit(mgr, req)
    assert mgr.get_computed_blocks(make_request("s", range(18), block_size=4))[1] == 16


@pytest.mark.parametrize("hash_block_size", [2, 8])
def test_unitary_refuses_hashes_made_at_another_block_size(hash_block_size):
    """A request hashed with another block size must not be cached under wrong hashes (a false hit
    would reuse another prompt's KV) nor leave the ledger half-changed."""
    mgr = make_manager(20, full_spec(4))
    req = make_request("r", range(20), block_size=hash_block_size)
    before = snapshot(mgr)
    with pytest.raises(ValueError):
        mgr.get_computed_blocks(req)
    with pytest.raises(ValueError):
        mgr.allocate_slots(req, 20)
    assert snapshot(mgr) == before
    check_invariants(mgr)


# 4 ------------------------------------------------------------------------------------------------
def test_hybrid_needs_at_least_two_spec_groups():
    with pytest.raises(ValueError):
        HybridKVCacheCoordinator(make_config(10, full_spec(4)), 16, False)
    with pytest.raises(ValueError):
        HybridKVCacheCoordinator(make_config(10, full_spec(4), full_spec(4)), 16, False)
    # The factory never asks for it: one group is unitary.
    assert isinstance(get_kv_cache_coordinator(make_config(10, full_spec(4)), 16, True), UnitaryKVCacheCoordinator)
    assert isinstance(
        get_kv_cache_coordinator(make_config(10, full_spec(4), swa_spec(4, 8)), 16, True), HybridKVCacheCoordinator
    )


# 5 ------------------------------------------------------------------------------------------------
def test_setting_a_hash_twice_is_refused():
    block = KVCacheBlock(3)
    block.block_hash = b"h" * 8
    with pytest.raises(AssertionError):
        block.block_hash = b"g" * 8
    block.reset_hash()
    block.block_hash = b"g" * 8
    assert block.block_hash == b"g" * 8


def test_caching_an_already_cached_block_is_refused():
    class Req:
        block_hashes: ClassVar[list[bytes]] = [b"a" * 8]
        all_token_ids: ClassVar[list[int]] = [1, 2, 3, 4]

    pool = BlockPool(4, enable_caching=True)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(Req(), blocks, 0, 1, 4, 0)
    with pytest.raises(AssertionError):
        pool.cache_full_blocks(Req(), blocks, 0, 1, 4, 0)


# 6 ------------------------------------------------------------------------------------------------
def test_reset_prefix_cache_refused_while_any_block_is_used(caplog):
    pool = BlockPool(5, enable_caching=True, enable_kv_cache_events=True)
    (blk,) = pool.get_new_blocks(1)
    with caplog.at_level(logging.WARNING):
        assert pool.reset_prefix_cache() is False
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert pool.take_events() == []
    pool.free_blocks([blk])
    assert pool.reset_prefix_cache() is True  # only the null block is "held": allowed


# 7 ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 8, 10**9])
def test_evict_blocks_rejects_out_of_range_ids(bad):
    pool = BlockPool(8, enable_caching=True)
    with pytest.raises(ValueError):
        pool.evict_blocks([bad])


def test_evict_blocks_rejects_the_null_block():
    pool = BlockPool(8, enable_caching=True)
    with pytest.raises(ValueError):
        pool.evict_blocks([0])


# English seed, "Errors and edge cases" rows not covered by the files above -------------------------
def test_allocate_slots_too_few_free_blocks_returns_none_and_the_scheduler_can_preempt():
    mgr = make_manager(5, full_spec(4))  # 4 usable
    a = make_request("a", range(100, 112), block_size=4)  # 3 blocks
    admit(mgr, a)
    b = make_request("b", range(8), block_size=4)  # 2 blocks: 2 > 1 free
    before = snapshot(mgr)
    assert admit(mgr, b)[0] is None
    assert snapshot(mgr) == before
    mgr.free(a)  # preempt a
    assert admit(mgr, b)[0] is not None
    check_invariants(mgr)


def test_pool_needs_at_least_two_blocks():
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)
    pool = BlockPool(2, enable_caching=True)
    assert pool.get_num_free_blocks() == 1
