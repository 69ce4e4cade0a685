"""One test (or a small group) per rule of the seeds: queue discipline, pool operations, events,
allocate_slots' gates, hashing, sliding window, coordinators and memory planning."""

import hashlib
import logging
import os
import subprocess
import sys

import pytest
import xxhash

from engine_core.kv_cache.block import KVCacheBlock, make_block_hash_with_group_id
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    get_kv_cache_coordinator,
)
from engine_core.kv_cache.free_queue import FreeKVCacheBlockQueue
from engine_core.kv_cache.hashing import get_hash_fn, hash_block_tokens
from engine_core.kv_cache.planning import (
    KVCacheSizingError,
    blocks_per_request,
    bytes_per_block,
    get_kv_cache_config,
    get_kv_cache_groups,
    get_num_blocks,
)
from engine_core.kv_cache.single_type_manager import FullAttentionManager, SlidingWindowManager
from engine_core.request import RequestStatus
from protocol.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from protocol.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, external_block_hash
from tests.engine_core.ledger_support import (
    admit,
    cdiv,
    check_invariants,
    decode,
    full_spec,
    ids,
    make_config,
    make_manager,
    make_request,
    queue_ids,
    snapshot,
    swa_spec,
)


class FakeRequest:
    """Just what BlockPool.cache_full_blocks reads."""

    def __init__(self, block_hashes, token_ids):
        self.block_hashes = block_hashes
        self.all_token_ids = token_ids
        self.cache_salt = None


def cache(pool, blocks, hashes, group_id=0, block_size=4):
    """Register blocks under the given hashes (block i <- hashes[i])."""
    tokens = list(range(len(blocks) * block_size))
    pool.cache_full_blocks(FakeRequest(hashes, tokens), blocks, 0, len(blocks), block_size, group_id)


# =========================================================================== queue discipline


def test_initial_queue_is_in_block_id_order_and_null_block_is_taken_first():
    pool = BlockPool(8, enable_caching=True)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert queue_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.get_num_free_blocks() == 7


def test_new_blocks_come_from_the_front():
    pool = BlockPool(8, enable_caching=True)
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert queue_ids(pool) == [6, 7]
    assert all(pool.blocks[i].ref_cnt == 1 for i in range(1, 6))


def test_uncached_frees_go_to_the_front_in_the_order_given():
    pool = BlockPool(8, enable_caching=True)
    b = pool.get_new_blocks(4)  # 1..4
    pool.free_blocks([b[2], b[0]])
    assert queue_ids(pool) == [3, 1, 5, 6, 7]
    pool.free_blocks([b[1], b[3]])
    assert queue_ids(pool) == [2, 4, 3, 1, 5, 6, 7]
    assert ids(pool.get_new_blocks(2)) == [2, 4]


def test_cached_frees_go_to_the_back_in_the_order_given():
    pool = BlockPool(8, enable_caching=True)
    b = pool.get_new_blocks(4)  # 1..4
    cache(pool, b, [bytes([i]) * 8 for i in range(4)])
    pool.free_blocks([b[3], b[1]])
    assert queue_ids(pool) == [5, 6, 7, 4, 2]
    # One call with both kinds: the uncached ones to the front, the cached ones to the back.
    extra = pool.get_new_blocks(1)  # block 5
    pool.free_blocks([b[0], extra[0], b[2]])
    assert queue_ids(pool) == [5, 6, 7, 4, 2, 1, 3]


def test_free_of_a_request_releases_its_blocks_last_first():
    mgr = make_manager(10, full_spec(4), enable_caching=False)
    req = make_request("r", range(10), block_size=4)
    admit(mgr, req)
    assert mgr.get_block_ids("r") == [[1, 2, 3]]
    mgr.free(req)
    assert queue_ids(mgr.block_pool)[:3] == [3, 2, 1]  # uncached: to the front, last block first


def test_free_of_a_cached_request_puts_its_tail_before_its_head_in_eviction_order():
    mgr = make_manager(10, full_spec(4))
    req = make_request("r", range(13), block_size=4)  # 3 full blocks + 1 token
    admit(mgr, req)
    mgr.free(req)
    assert queue_ids(mgr.block_pool) == [4, 5, 6, 7, 8, 9, 3, 2, 1]


def test_shared_block_freed_once_stays_out_of_the_queue():
    pool = BlockPool(6, enable_caching=True)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([[blk]])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in queue_ids(pool)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and queue_ids(pool)[0] == blk.block_id
    with pytest.raises(RuntimeError):
        pool.free_blocks([blk])  # freeing more often than taken is a ledger bug, loudly


def test_free_queue_removes_from_the_middle_and_pops_in_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[3])
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 4, 5] and q.num_free_blocks == 5
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(2)) == [1, 2]
    q.append(blocks[0])
    q.prepend_n([blocks[1], blocks[2]])
    assert ids(q.get_all_free_blocks()) == [1, 2, 4, 5, 0]
    with pytest.raises(RuntimeError):
        q.remove(blocks[3])  # not in the queue
    with pytest.raises(ValueError):
        q.popleft_n(6)
    assert q.num_free_blocks == 5


# =========================================================================== pool operations


def test_get_new_blocks_evicts_a_reused_blocks_hash_and_emits_block_removed():
    pool = BlockPool(4, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks, [b"h0", b"h1", b"h2"])
    pool.take_events()
    pool.free_blocks(reversed(blocks))  # all cached: queue 3, 2, 1
    assert queue_ids(pool) == [3, 2, 1]
    assert pool.get_cached_block(b"h2", [0]) == [blocks[2]]
    (reused,) = pool.get_new_blocks(1)
    assert reused is blocks[2]
    assert reused.block_hash is None and reused.ref_cnt == 1
    assert pool.get_cached_block(b"h2", [0]) is None
    assert pool.get_cached_block(b"h1", [0]) == [blocks[1]]
    assert pool.take_events() == [BlockRemoved(block_hashes=[external_block_hash(b"h2")], medium=MEDIUM_GPU, group_idx=0)]


def test_touch_takes_a_free_hit_out_of_the_queue():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks, [b"a", b"b", b"c"])
    pool.free_blocks(blocks)
    assert queue_ids(pool) == [4, 5, 1, 2, 3]
    pool.touch([[blocks[1]]])  # from the middle of the queue
    assert blocks[1].ref_cnt == 1
    assert queue_ids(pool) == [4, 5, 1, 3]
    pool.touch([[blocks[1]]])  # an in-use block only gains a reference
    assert blocks[1].ref_cnt == 2 and pool.get_num_free_blocks() == 4
    pool.touch([[pool.null_block]])  # the null block is never counted
    assert pool.null_block.ref_cnt == 0 and 0 not in queue_ids(pool)


def test_get_cached_block_with_several_groups_any_miss_is_none():
    pool = BlockPool(8, enable_caching=True)
    g0, g1, g2 = (pool.get_new_blocks(1) for _ in range(3))
    cache(pool, g0, [b"same"], group_id=0)
    cache(pool, g1, [b"same"], group_id=1)
    cache(pool, g2, [b"other"], group_id=2)
    assert pool.get_cached_block(b"same", [0, 1]) == [g0[0], g1[0]]
    assert pool.get_cached_block(b"same", [1, 0]) == [g1[0], g0[0]]
    assert pool.get_cached_block(b"same", [0, 1, 2]) is None
    assert pool.get_cached_block(b"same", [2]) is None
    assert pool.get_cached_block(b"other", [2]) == [g2[0]]
    # One block's hash carries its group id.
    assert g1[0].block_hash == make_block_hash_with_group_id(b"same", 1)


def test_two_blocks_under_one_hash_both_stay_findable():
    pool = BlockPool(6, enable_caching=True)
    x, y = pool.get_new_blocks(2)
    cache(pool, [x], [b"dup"])
    cache(pool, [y], [b"dup"])
    assert pool.get_cached_block(b"dup", [0])[0] in (x, y)
    pool.evict_blocks([x.block_id])
    assert pool.get_cached_block(b"dup", [0]) == [y]
    pool.evict_blocks([y.block_id])
    assert pool.get_cached_block(b"dup", [0]) is None


def test_evict_blocks_drops_hashes_but_not_ownership():
    pool = BlockPool(6, enable_caching=True, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks, [b"a", b"b", b"c"])
    pool.free_blocks([blocks[2]])
    pool.take_events()
    pool.evict_blocks([blocks[0].block_id, blocks[2].block_id, 5])  # 5 is free and uncached: no-op
    assert blocks[0].block_hash is None and blocks[2].block_hash is None
    assert blocks[1].block_hash is not None
    assert [b.ref_cnt for b in blocks] == [1, 1, 0]
    assert pool.get_cached_block(b"a", [0]) is None and pool.get_cached_block(b"c", [0]) is None
    assert blocks[2].block_id in queue_ids(pool)
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[external_block_hash(b"a")], medium=MEDIUM_GPU, group_idx=0),
        BlockRemoved(block_hashes=[external_block_hash(b"c")], medium=MEDIUM_GPU, group_idx=0),
    ]


@pytest.mark.parametrize("bad", [-1, 6, 100, 0])
def test_evict_blocks_out_of_range_id_is_value_error(bad):
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [b"a", b"b"])
    with pytest.raises(ValueError):
        pool.evict_blocks([bad])
    assert pool.get_cached_block(b"a", [0]) == [blocks[0]]


def test_reset_prefix_cache_refuses_with_a_warning_while_blocks_are_in_use(caplog):
    mgr = make_manager(8, full_spec(4), enable_kv_cache_events=True)
    req = make_request("r", range(9), block_size=4)
    admit(mgr, req)
    mgr.take_events()
    before = snapshot(mgr)
    with caplog.at_level(logging.WARNING):
        assert mgr.reset_prefix_cache() is False
    assert any(r.levelno == logging.WARNING for r in caplog.records)
    assert snapshot(mgr) == before
    assert mgr.take_events() == []


def test_reset_prefix_cache_succeeds_when_nothing_is_in_use():
    mgr = make_manager(8, full_spec(4), enable_kv_cache_events=True)
    req = make_request("r", range(9), block_size=4)
    admit(mgr, req)
    mgr.free(req)
    mgr.take_events()
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    assert len(mgr.block_pool.cached_block_hash_to_block) == 0
    assert mgr.get_computed_blocks(make_request("s", range(9), block_size=4))[1] == 0
    check_invariants(mgr)


def test_kv_events_stored_with_parent_hash_and_token_ids_then_removed():
    mgr = make_manager(5, full_spec(4), enable_kv_cache_events=True)
    req = make_request("r", range(10), block_size=4)
    admit(mgr, req)

    def h(i):  # a hash as the events carry it
        return external_block_hash(req.block_hashes[i])

    stored = {"lora_id": None, "medium": MEDIUM_GPU, "lora_name": None, "group_idx": 0,
              "kv_cache_spec_kind": "full_attention"}
    assert mgr.take_events() == [
        BlockStored(block_hashes=[h(0), h(1)], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                    extra_keys=[None, None], **stored)
    ]
    req.append_output_token_ids([10])
    decode(mgr, req, 11)  # 11 computed: block 2 not full yet
    assert mgr.take_events() == []
    decode(mgr, req, 12)  # 12 computed: block 2 is full
    assert mgr.take_events() == [
        BlockStored(block_hashes=[h(2)], parent_block_hash=h(1), token_ids=[8, 9, 10, 11], block_size=4,
                    extra_keys=[None], **stored)
    ]
    mgr.free(req)
    other = make_request("o", range(100, 116), block_size=4)
    admit(mgr, other)  # 4 blocks: the uncached tail, then the cached blocks of r (evicted)
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[h(2)], [h(1)], [h(0)]]


def test_no_events_unless_enabled():
    mgr = make_manager(6, full_spec(4))
    req = make_request("r", range(9), block_size=4)
    admit(mgr, req)
    mgr.free(req)
    mgr.reset_prefix_cache()
    assert mgr.take_events() == []


def test_get_usage_is_one_minus_free_over_usable():
    mgr = make_manager(11, full_spec(4))
    assert mgr.get_usage() == 0.0
    reqs = [make_request(i, range(100 * i, 100 * i + 8), block_size=4) for i in range(3)]
    for k, req in enumerate(reqs, start=1):
        admit(mgr, req)
        assert mgr.get_usage() == pytest.approx(1 - (10 - 2 * k) / 10)
        assert mgr.get_usage() == 1 - mgr.get_num_free_blocks() / 10
    mgr.free(reqs[0])  # cached blocks count as free
    assert mgr.get_usage() == pytest.approx(0.4)


def test_allocate_slots_with_no_new_and_no_computed_tokens_is_value_error():
    mgr = make_manager(8, full_spec(4))
    req = make_request("r", range(5), block_size=4)
    before = snapshot(mgr)
    with pytest.raises(ValueError):
        mgr.allocate_slots(req, 0)
    assert snapshot(mgr) == before


def test_get_new_blocks_beyond_free_is_value_error():
    pool = BlockPool(5, enable_caching=True)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2 and queue_ids(pool) == [3, 4]


def test_a_partial_block_is_never_cached():
    mgr = make_manager(8, full_spec(4))
    req = make_request("r", range(7), block_size=4)
    admit(mgr, req)
    b0, b1 = mgr.get_blocks("r").blocks[0]
    assert b0.block_hash is not None and b1.block_hash is None


# =========================================================================== allocate_slots gates


@pytest.mark.parametrize(
    "status, has_scheduled, watermarked",
    [
        (RequestStatus.WAITING, True, True),
        (RequestStatus.PREEMPTED, True, True),
        (RequestStatus.WAITING, False, False),
        (RequestStatus.PREEMPTED, False, False),
        (RequestStatus.RUNNING, True, False),
    ],
)
def test_watermark_only_for_waiting_or_preempted_with_scheduled_requests(status, has_scheduled, watermarked):
    mgr = make_manager(21, full_spec(4), watermark=0.1)  # 2 watermark blocks, 20 usable
    assert mgr.watermark_blocks == 2
    filler = make_request("filler", range(1000, 1000 + 4 * 17), block_size=4)  # 17 blocks
    admit(mgr, filler)
    assert mgr.get_num_free_blocks() == 3
    req = make_request("r", range(8), block_size=4)  # needs 2 blocks: 2 + 2 > 3 with the watermark
    req.status = status
    before = snapshot(mgr)
    out = mgr.allocate_slots(req, 8, has_scheduled_reqs=has_scheduled)
    if watermarked:
        assert out is None and snapshot(mgr) == before
    else:
        assert out is not None and out.num_new_blocks() == 2


def test_full_sequence_must_fit_gate_counts_the_whole_sequence():
    mgr = make_manager(5, full_spec(4))  # 4 usable
    req = make_request("r", range(20), block_size=4)  # 5 blocks in all
    before = snapshot(mgr)
    assert mgr.allocate_slots(req, 4, full_sequence_must_fit=True) is None
    assert snapshot(mgr) == before
    out = mgr.allocate_slots(req, 4, full_sequence_must_fit=False)  # one chunk alone fits
    assert out.num_new_blocks() == 1


def test_full_sequence_must_fit_is_capped_by_max_model_len():
    mgr = make_manager(5, full_spec(4), max_model_len=16)  # 4 usable blocks = 16 tokens
    req = make_request("r", range(20), block_size=4)
    assert mgr.allocate_slots(req, 4, full_sequence_must_fit=True) is not None


def test_lookahead_slots_are_allocated_but_not_cached():
    mgr = make_manager(10, full_spec(4))
    req = make_request("r", range(8), block_size=4)
    out = mgr.allocate_slots(req, 8, num_lookahead_tokens=4)
    blocks = out.blocks[0]
    assert len(blocks) == 3
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    req2 = make_request("s", range(7), block_size=4)
    out2 = mgr.allocate_slots(req2, 7, num_lookahead_tokens=1)  # 8 slots, but only 7 real tokens
    assert len(out2.blocks[0]) == 2
    assert [b.block_hash is not None for b in out2.blocks[0]] == [True, False]


def test_caching_stops_at_request_num_tokens():
    # num_new_tokens may include draft tokens that the request does not hold yet.
    mgr = make_manager(10, full_spec(4))
    req = make_request("r", range(5), block_size=4)
    out = mgr.allocate_slots(req, 8)
    assert [b.block_hash is not None for b in out.blocks[0]] == [True, False]
    assert mgr.coordinator.single_type_managers[0].num_cached_block["r"] == 1


def test_returned_blocks_are_only_those_new_to_the_call():
    mgr = make_manager(10, full_spec(4))
    owner = make_request("o", range(9), block_size=4)
    admit(mgr, owner)
    req = make_request("r", list(range(8)) + [50, 51, 52], block_size=4)
    out, hit = admit(mgr, req)
    assert hit == 8 and out.get_block_ids() == [[4]]
    assert mgr.get_block_ids("r") == [[1, 2, 4]]


# =========================================================================== prefix hits and hashing


@pytest.mark.parametrize("prompt_len, expected_hit", [(32, 16), (33, 32), (31, 16), (17, 16), (16, 0)])
def test_prefix_hit_never_covers_the_last_prompt_token(prompt_len, expected_hit):
    mgr = make_manager(20, full_spec(16))
    owner = make_request("owner", range(64))
    admit(mgr, owner)
    req = make_request("r", range(prompt_len))
    _hits, num_hit = mgr.get_computed_blocks(req)
    assert num_hit == expected_hit < prompt_len
    out, _ = admit(mgr, req)
    assert out is not None and req.num_computed_tokens == prompt_len


def test_cache_salt_changes_the_first_hash_and_so_every_chained_hash():
    tokens = list(range(64))
    plain = make_request("a", tokens)
    salted = make_request("b", tokens, cache_salt="tenant-1")
    salted_again = make_request("c", tokens, cache_salt="tenant-1")
    other_salt = make_request("d", tokens, cache_salt="tenant-2")
    assert len(plain.block_hashes) == 4
    for i in range(4):
        assert len({plain.block_hashes[i], salted.block_hashes[i], other_salt.block_hashes[i]}) == 3
    assert salted.block_hashes == salted_again.block_hashes

    mgr = make_manager(20, full_spec(16))
    admit(mgr, plain)
    assert mgr.get_computed_blocks(make_request("e", tokens + [1], cache_salt="tenant-1"))[1] == 0
    assert mgr.get_computed_blocks(make_request("f", tokens + [1]))[1] == 64


def test_block_hashes_chain_through_the_parent():
    fn = get_hash_fn("sha256")
    h0 = hash_block_tokens(fn, None, [1, 2, 3, 4])
    h1 = hash_block_tokens(fn, h0, [5, 6, 7, 8])
    req = make_request("r", range(1, 9), block_size=4)
    assert req.block_hashes == [h0, h1]
    # Same tokens, different parent: different hash.
    assert hash_block_tokens(fn, h1, [5, 6, 7, 8]) != h1
    # Hashes are extended incrementally as output tokens arrive.
    req.append_output_token_ids([9, 10, 11])
    assert len(req.block_hashes) == 2
    req.append_output_token_ids([12])
    assert req.block_hashes == [h0, h1, hash_block_tokens(fn, h1, [9, 10, 11, 12])]


_HASH_SCRIPT = """
from engine_core.kv_cache.hashing import get_hash_fn, get_request_block_hasher
from engine_core.request import Request
for name in ("sha256", "xxhash"):
    r = Request("x", list(range(40)), cache_salt="salt", block_hasher=get_request_block_hasher(8, get_hash_fn(name)))
    print(name, ",".join(h.hex() for h in r.block_hashes))
"""


def _hashes_here():
    out = []
    for name in ("sha256", "xxhash"):
        r = make_request("x", range(40), block_size=8, cache_salt="salt", hash_name=name)
        out.append(f"{name} " + ",".join(h.hex() for h in r.block_hashes))
    return out


def test_hashes_are_identical_across_processes_and_hash_seeds():
    seen = []
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True, text=True, check=True)
        seen.append(res.stdout.split("\n")[:2])
    assert seen[0] == seen[1] == seen[2] == _hashes_here()


def test_sha256_and_xxhash_are_selectable():
    assert get_hash_fn("sha256")(b"abc") == hashlib.sha256(b"abc").digest()
    assert get_hash_fn("xxhash")(b"abc") == xxhash.xxh3_128_digest(b"abc")
    with pytest.raises(ValueError):
        get_hash_fn("md5")
    a = make_request("a", range(32), hash_name="sha256")
    b = make_request("b", range(32), hash_name="xxhash")
    assert len(a.block_hashes[0]) == 32 and len(b.block_hashes[0]) == 16
    assert a.block_hashes != b.block_hashes
    for name in ("sha256", "xxhash"):
        mgr = make_manager(10, full_spec(16))
        admit(mgr, make_request("o", range(40), hash_name=name))
        assert mgr.get_computed_blocks(make_request("p", range(40), hash_name=name))[1] == 32


def test_prefix_cache_stats_count_admissions_in_tokens():
    mgr = make_manager(10, full_spec(4))
    admit(mgr, make_request("a", range(9), block_size=4))
    admit(mgr, make_request("b", range(9), block_size=4))
    s = mgr.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (2, 18, 8)


# =========================================================================== sliding window


def test_sliding_window_blocks_outside_the_window_become_null_and_are_freed():
    mgr = make_manager(12, swa_spec(4, window=8), max_num_batched_tokens=16)
    req = make_request("r", range(20), block_size=4)
    admit(mgr, req)
    assert mgr.get_block_ids("r") == [[1, 2, 3, 4, 5]]
    req.append_output_token_ids([20])
    # The token at position 20 attends to positions 13..20: blocks 0..2 (tokens 0..11) are skipped.
    out = decode(mgr, req, 21)
    assert out.get_block_ids() == [[6]]
    assert mgr.get_block_ids("r") == [[0, 0, 0, 4, 5, 6]]
    pool = mgr.block_pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [0, 0, 0]
    # They were cached, so they go to the back, dropped last-first.
    assert queue_ids(pool)[-3:] == [3, 2, 1]
    check_invariants(mgr, {"r": req})
    mgr.free(req)
    assert mgr.get_num_free_blocks() == 11
    check_invariants(mgr)


@pytest.mark.parametrize("window", [5, 8, 9, 12, 13])
def test_sliding_window_hit_needs_only_the_last_cdiv_window_minus_1_blocks(window):
    bs = 4
    needed = cdiv(window - 1, bs)
    for kept in range(1, 6):
        mgr = make_manager(20, swa_spec(bs, window=window), max_num_batched_tokens=64)
        owner = make_request("o", range(24), block_size=bs)  # 6 full blocks
        admit(mgr, owner)
        mgr.free(owner)
        held = [b.block_id for b in mgr.block_pool.blocks[1:7]]
        mgr.block_pool.evict_blocks(held[: 6 - kept])  # keep only the last `kept` blocks cached
        req = make_request("r", list(range(24)) + [99], block_size=bs)
        hits, num_hit = mgr.get_computed_blocks(req)
        if kept >= needed:
            assert num_hit == 24
            assert ids(hits.blocks[0]) == [0] * (6 - needed) + held[6 - needed :]
        else:
            assert num_hit == 0 and hits.blocks[0] == []
        out, _ = admit(mgr, req)
        assert out is not None
        check_invariants(mgr, {"r": req})


def test_sliding_window_hit_from_block_zero_is_usable_without_a_full_window():
    mgr = make_manager(20, swa_spec(4, window=13), max_num_batched_tokens=64)  # needs 3 blocks
    owner = make_request("o", range(24), block_size=4)
    admit(mgr, owner)
    mgr.free(owner)
    mgr.block_pool.evict_blocks([3, 5])  # blocks 2 and 4 missing: no 3-block run; blocks 0, 1 start it
    req = make_request("r", list(range(24)) + [99], block_size=4)
    hits, num_hit = mgr.get_computed_blocks(req)
    assert num_hit == 8 and ids(hits.blocks[0]) == [1, 2]


def test_sliding_window_admission_cap_lets_a_long_prompt_in_and_is_never_exceeded():
    bs, window, chunk = 4, 8, 8
    mgr = make_manager(7, swa_spec(bs, window=window), max_num_batched_tokens=chunk)  # 6 usable
    swm = mgr.coordinator.single_type_managers[0]
    assert isinstance(swm, SlidingWindowManager)
    cap = cdiv(window - 1 + chunk, bs) + 1
    assert swm.max_admission_blocks_per_request == cap == 5
    # The planner sizes requests with the same cap.
    assert blocks_per_request(make_config(7, swa_spec(bs, window=window)).kv_cache_groups, 40, chunk) == cap

    req = make_request("r", range(40), block_size=bs)  # 10 blocks if nothing were dropped
    out, _ = admit(mgr, req, num_new_tokens=chunk)
    assert out is not None
    while req.num_computed_tokens < req.num_tokens:
        assert mgr.allocate_slots(req, chunk) is not None
        req.num_computed_tokens += chunk
        assert sum(not b.is_null for b in swm.get_blocks("r")) <= cap
    req.append_output_token_ids([1])
    for _ in range(30):
        assert decode(mgr, req) is not None
        assert sum(not b.is_null for b in swm.get_blocks("r")) <= cap
        check_invariants(mgr, {"r": req})

    # The same prompt under full attention cannot be admitted into this pool.
    full = make_manager(7, full_spec(bs), max_num_batched_tokens=chunk)
    assert admit(full, make_request("r", range(40), block_size=bs), num_new_tokens=chunk)[0] is None


# =========================================================================== coordinators


def test_coordinator_choice():
    one = make_config(10, full_spec(4))
    two = make_config(10, full_spec(4), swa_spec(4, 8))
    assert type(get_kv_cache_coordinator(one, 16, enable_caching=False)) is KVCacheCoordinatorNoPrefixCache
    assert type(get_kv_cache_coordinator(two, 16, enable_caching=False)) is KVCacheCoordinatorNoPrefixCache
    assert type(get_kv_cache_coordinator(one, 16, enable_caching=True)) is UnitaryKVCacheCoordinator
    assert type(get_kv_cache_coordinator(two, 16, enable_caching=True)) is HybridKVCacheCoordinator
    coord = get_kv_cache_coordinator(two, 16, enable_caching=True)
    assert [type(m) for m in coord.single_type_managers] == [FullAttentionManager, SlidingWindowManager]
    assert coord.single_type_managers[0].block_pool is coord.single_type_managers[1].block_pool
    assert coord.block_pool.num_gpu_blocks == 10


def test_no_prefix_cache_coordinator_never_hits_nor_hashes():
    mgr = make_manager(10, full_spec(4), swa_spec(4, 8), enable_caching=False)
    assert mgr.coordinator.find_longest_cache_hit([b"x"] * 3, 12) == (([], []), 0)
    req = make_request("r", range(9), block_size=4)
    admit(mgr, req)
    mgr.free(req)
    assert all(b.block_hash is None for b in mgr.block_pool.blocks)
    again = make_request("s", range(9), block_size=4)
    assert mgr.get_computed_blocks(again)[1] == 0


def _hybrid_with_cached_prompt(*specs, num_blocks=40):
    mgr = make_manager(num_blocks, *specs, max_num_batched_tokens=64)
    owner = make_request("o", range(24), block_size=4)
    admit(mgr, owner)
    table = mgr.get_block_ids("o")
    mgr.free(owner)
    return mgr, table


def test_hybrid_hit_full_and_sliding():
    mgr, table = _hybrid_with_cached_prompt(full_spec(4), swa_spec(4, 8))
    assert table == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]]
    hits, n = mgr.get_computed_blocks(make_request("r", list(range(24)) + [99], block_size=4))
    assert n == 24
    assert hits.get_block_ids() == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 11, 12]]


def test_hybrid_full_attention_bounds_the_sliding_group():
    mgr, table = _hybrid_with_cached_prompt(full_spec(4), swa_spec(4, 8))
    mgr.block_pool.evict_blocks([table[0][3]])  # full attention misses block 3
    hits, n = mgr.get_computed_blocks(make_request("r", list(range(24)) + [99], block_size=4))
    assert n == 12
    assert hits.get_block_ids() == [[1, 2, 3], [0, 8, 9]]


def test_hybrid_sliding_group_shortens_the_full_attention_hit():
    mgr, table = _hybrid_with_cached_prompt(full_spec(4), swa_spec(4, 8))
    mgr.block_pool.evict_blocks([table[1][4], table[1][2]])  # no 2-block run except blocks 0-1
    req = make_request("r", list(range(24)) + [99], block_size=4)
    hits, n = mgr.get_computed_blocks(req)
    assert n == 8
    assert hits.get_block_ids() == [[1, 2], [7, 8]]
    out, _ = admit(mgr, req)
    assert out is not None and req.num_computed_tokens == 25
    check_invariants(mgr, {"r": req})


def test_hybrid_equal_specs_are_searched_together_full_attention_first():
    full, swa = full_spec(4), swa_spec(4, 8)
    config = make_config(40, swa, full, full)
    assert HybridKVCacheCoordinator.verify_and_split_kv_cache_groups(config) == [(full, [1, 2]), (swa, [0])]
    mgr, table = _hybrid_with_cached_prompt(full, full, swa)
    assert HybridKVCacheCoordinator.verify_and_split_kv_cache_groups(mgr.coordinator.kv_cache_config) == [
        (full, [0, 1]),
        (swa, [2]),
    ]
    mgr.block_pool.evict_blocks([table[1][2]])  # one full group misses block 2: both stop there
    hits, n = mgr.get_computed_blocks(make_request("r", list(range(24)) + [99], block_size=4))
    assert n == 8
    assert hits.get_block_ids() == [[1, 2], [7, 8], [13, 14]]


def test_hybrid_groups_must_share_one_block_size():
    config = make_config(10, full_spec(4), swa_spec(8, 16))
    with pytest.raises(ValueError):
        HybridKVCacheCoordinator(config, 16, False)


# =========================================================================== planning


def _specs(n_full=1, n_swa=0, block_size=16, window=64):
    specs = {f"full.{i}": FullAttentionSpec(block_size, 2, 64, 2) for i in range(n_full)}
    specs.update({f"swa.{i}": SlidingWindowSpec(block_size, 2, 64, 2, window) for i in range(n_swa)})
    return specs


def test_planning_no_memory_is_a_clear_error():
    page = FullAttentionSpec(16, 2, 64, 2).page_size_bytes
    for available in (0, page - 1):
        with pytest.raises(ValueError, match="No available memory for the cache blocks: one block needs 8"):
            get_kv_cache_config(_specs(), [available], max_model_len=16, max_num_batched_tokens=16)
    with pytest.raises(KVCacheSizingError):
        get_num_blocks(10, 11)
    # One rank short of memory fails the whole start-up.
    with pytest.raises(KVCacheSizingError, match="No available memory"):
        get_kv_cache_config(_specs(), [100 * page, 0], max_model_len=16, max_num_batched_tokens=16)


def test_planning_max_model_len_that_does_not_fit_names_the_largest_that_would():
    page = FullAttentionSpec(16, 2, 64, 2).page_size_bytes
    # 10 blocks, 9 usable = 144 tokens.
    assert get_kv_cache_config(_specs(), [10 * page], max_model_len=144, max_num_batched_tokens=16).num_blocks == 10
    with pytest.raises(ValueError, match="estimated maximum model length is 144") as err:
        get_kv_cache_config(_specs(), [10 * page], max_model_len=145, max_num_batched_tokens=16)
    assert isinstance(err.value, KVCacheSizingError)
    # Sizes in a unit that says something, beside the block counts (a block here is 8 KiB).
    assert "needs 10 blocks (80 KiB) of KV cache, more than the 9 usable blocks (72 KiB) available" in str(err.value)
    with pytest.raises(KVCacheSizingError, match="estimated maximum model length is 144"):
        get_kv_cache_config(_specs(), [10 * page], max_model_len=100_000, max_num_batched_tokens=16)


def test_planning_takes_the_minimum_across_ranks():
    page = FullAttentionSpec(16, 2, 64, 2).page_size_bytes
    config = get_kv_cache_config(
        _specs(), [20 * page, 12 * page + page - 1, 15 * page], max_model_len=16, max_num_batched_tokens=16
    )
    assert config.num_blocks == 12


def test_planning_num_gpu_blocks_override_replaces_the_count():
    page = FullAttentionSpec(16, 2, 64, 2).page_size_bytes
    kw = {"max_model_len": 16, "max_num_batched_tokens": 16}
    assert get_kv_cache_config(_specs(), [20 * page], num_gpu_blocks_override=50, **kw).num_blocks == 50
    assert get_kv_cache_config(_specs(), [20 * page], num_gpu_blocks_override=5, **kw).num_blocks == 5
    with pytest.raises(KVCacheSizingError, match="estimated maximum model length is 32"):
        get_kv_cache_config(_specs(), [20 * page], max_model_len=64, max_num_batched_tokens=16,
                            num_gpu_blocks_override=3)


def test_planning_groups_hybrid_layers_by_spec_in_equal_sized_groups():
    specs = _specs(n_full=4, n_swa=2)
    groups = get_kv_cache_groups(specs)
    full, swa = specs["full.0"], specs["swa.0"]
    assert [(g.layer_names, g.kv_cache_spec) for g in groups] == [
        (["full.0", "full.1"], full),
        (["full.2", "full.3"], full),
        (["swa.0", "swa.1"], swa),
    ]
    assert bytes_per_block(groups) == 2 * full.page_size_bytes
    # All layers equal: one group.
    assert len(get_kv_cache_groups(_specs(n_full=6))) == 1
    # Different page sizes cannot share block ids.
    bad = dict(_specs(n_full=2), odd=SlidingWindowSpec(16, 4, 64, 2, 64))
    with pytest.raises(KVCacheSizingError):
        get_kv_cache_groups(bad)
    # The resulting config drives the hybrid coordinator, equal specs searched together.
    config = get_kv_cache_config(specs, [100 * 2 * full.page_size_bytes], max_model_len=64, max_num_batched_tokens=16)
    coord = get_kv_cache_coordinator(config, 16, enable_caching=True)
    assert isinstance(coord, HybridKVCacheCoordinator)
    assert coord.spec_groups == [(full, [0, 1]), (swa, [2])]


def test_planning_sliding_window_request_size_is_capped():
    groups = get_kv_cache_groups(_specs(n_full=0, n_swa=2, block_size=16, window=64))
    # cdiv(64 - 1 + 256, 16) + 1 = 21 blocks at most, however long the request.
    assert blocks_per_request(groups, 10_000, 256) == 21
    assert blocks_per_request(groups, 100, 256) == 7
