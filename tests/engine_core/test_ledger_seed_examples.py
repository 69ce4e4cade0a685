"""Every worked example of the English seed, with the seed's own numbers.

- Deep dive "Worked example: Llama-3.1-8B on one 80 GiB GPU" (sizing and the capacity line).
- Deep dive "Reference counts and sharing, step by step" (the R1/R2 table, row by row).
- "Check yourself" questions 2-5 (question 1 is about processes, not the ledger).
"""

import pytest

from engine_core.kv_cache.block import make_block_hash_with_group_id
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.kv_cache.planning import (
    blocks_per_request,
    bytes_per_block,
    capacity_line,
    get_kv_cache_config,
    get_kv_cache_groups,
)
from protocol.kv_cache_spec import FullAttentionSpec
from protocol.kv_events import MEDIUM_GPU, BlockRemoved, external_block_hash
from tests.engine_core.ledger_support import (
    admit,
    check_invariants,
    decode,
    full_spec,
    ids,
    make_manager,
    make_request,
    queue_ids,
    snapshot,
)

KiB, MiB = 1 << 10, 1 << 20


# --------------------------------------------------------------------------- Llama-3.1-8B sizing


def llama_8b_specs() -> dict:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2)
    return {f"model.layers.{i}.self_attn": spec for i in range(32)}


def test_llama_page_size_one_layer_one_block_is_64_kib():
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2)
    # 8 heads x 16 tokens x (128 + 128) x 2 bytes
    assert spec.page_size_bytes == 8 * 16 * (128 + 128) * 2 == 65_536 == 64 * KiB


def test_llama_one_block_all_layers_is_2_mib():
    groups = get_kv_cache_groups(llama_8b_specs())
    assert len(groups) == 1 and len(groups[0].layer_names) == 32
    assert bytes_per_block(groups) == 32 * 64 * KiB == 2 * MiB


def test_llama_27955_blocks_447280_tokens_and_3_41x():
    config = get_kv_cache_config(
        llama_8b_specs(), [55_910 * MiB], max_model_len=131_072, max_num_batched_tokens=8192
    )
    assert config.num_blocks == 55_910 // 2 == 27_955
    assert config.num_blocks - 1 == 27_954  # block 0 is the null block
    assert config.num_blocks * 16 == 447_280
    # One full-length request needs 8192 blocks; 27,955 / 8192 = 3.41.
    assert blocks_per_request(config.kv_cache_groups, 131_072, 8192) == 8192
    line = capacity_line(config, max_model_len=131_072, max_num_batched_tokens=8192)
    assert line == "KV cache size: 447,280 tokens, maximum concurrency for 131,072 tokens per request: 3.41x"


def test_llama_chat_request_holds_157_blocks():
    # 2000 prompt + 500 output tokens hold cdiv(2500, 16) = 157 blocks: 0.56 % of the pool, 314 MiB of KV.
    groups = get_kv_cache_groups(llama_8b_specs())
    assert blocks_per_request(groups, 2500, 8192) == 157
    assert round(157 / 27_955 * 100, 2) == 0.56
    assert 157 * bytes_per_block(groups) == 314 * MiB


# --------------------------------------------------------------------------- R1 / R2 reference counts


def test_r1_r2_reference_count_table_row_by_row():
    """Block size 16, prefix caching on. R1: 40-token prompt; R2: the same first 32 tokens."""
    num_blocks = 10
    mgr = make_manager(num_blocks, full_spec(16), enable_kv_cache_events=True)
    pool = mgr.block_pool
    a, b, c, d = (pool.blocks[i] for i in (1, 2, 3, 4))
    rest = list(range(5, num_blocks))
    r1 = make_request("R1", range(40))
    r2 = make_request("R2", list(range(32)) + [1000 + i for i in range(8)])
    assert r1.block_hashes[:2] == r2.block_hashes[:2]
    key = lambda req, i: make_block_hash_with_group_id(req.block_hashes[i], 0)

    # Row 1: R1 admitted: 3 new blocks a, b, c, removed from the front of the queue.
    assert queue_ids(pool) == [1, 2, 3, 4, *rest]
    out, hit = admit(mgr, r1)
    assert hit == 0
    assert out.get_block_ids() == [[1, 2, 3]]
    assert mgr.get_block_ids("R1") == [[1, 2, 3]]
    assert [a.ref_cnt, b.ref_cnt, c.ref_cnt] == [1, 1, 1]
    assert queue_ids(pool) == [4, *rest]

    # Row 2: R1 prefill done: a, b full and cached; c holds 8 tokens and has no hash.
    assert a.block_hash == key(r1, 0) and b.block_hash == key(r1, 1)
    assert c.block_hash is None
    r1.append_output_token_ids([500])  # the token sampled by the prefill step

    # Row 3: R2 admitted: hit a, b (touch), 1 new block d.
    out, hit = admit(mgr, r2)
    assert hit == 32
    assert out.get_block_ids() == [[4]]
    assert mgr.get_block_ids("R2") == [[1, 2, 4]]
    assert [a.ref_cnt, b.ref_cnt, c.ref_cnt, d.ref_cnt] == [2, 2, 1, 1]
    assert d.block_hash is None  # 8 tokens
    assert queue_ids(pool) == rest
    r2.append_output_token_ids([600])

    # Row 4: R1 finishes after 4 output tokens (c not full): free c, b, a.
    for tok in (501, 502, 503):
        assert decode(mgr, r1, tok).get_block_ids() == [[]]
    assert r1.num_output_tokens == 4 and r1.num_tokens == 44
    mgr.free(r1)
    assert [a.ref_cnt, b.ref_cnt, c.ref_cnt] == [1, 1, 0]
    assert queue_ids(pool) == [3, *rest]  # c at the front

    # Row 5: R2 finishes (d not full): free d, b, a.
    for tok in (601, 602, 603):
        assert decode(mgr, r2, tok).get_block_ids() == [[]]
    mgr.free(r2)
    assert [a.ref_cnt, b.ref_cnt, d.ref_cnt] == [0, 0, 0]
    # d to the front; b and a (cached) to the end in the order freed: d, c, ..., b, a.
    assert queue_ids(pool) == [4, 3, *rest, 2, 1]
    assert a.block_hash == key(r1, 0) and b.block_hash == key(r1, 1)
    check_invariants(mgr)

    # "A third request with the same 32 tokens would hit them."
    r3 = make_request("R3", list(range(32)) + [7])
    hits, num_hit = mgr.get_computed_blocks(r3)
    assert num_hit == 32 and ids(hits.blocks[0]) == [1, 2]

    # "A request that needs many new blocks would first take d and c, and only later evict b and a."
    mgr.take_events()
    big = make_request("BIG", [2000 + i for i in range(16 * 7)])
    out, hit = admit(mgr, big)
    assert hit == 0 and out.get_block_ids() == [[4, 3, *rest]]
    assert a.block_hash is not None and b.block_hash is not None
    assert not [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    one_more = make_request("ONE", [3000])
    out, _ = admit(mgr, one_more)
    assert out.get_block_ids() == [[2]]  # b is evicted before a
    assert b.block_hash is None and a.block_hash is not None
    assert [e for e in mgr.take_events() if isinstance(e, BlockRemoved)] == [
        BlockRemoved(block_hashes=[external_block_hash(r1.block_hashes[1])], medium=MEDIUM_GPU, group_idx=0)
    ]
    check_invariants(mgr)


# --------------------------------------------------------------------------- check yourself


def test_check_2_pool_of_1000_gives_999():
    pool = BlockPool(1000, enable_caching=True)
    assert pool.get_num_free_blocks() == 999
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    blocks = pool.get_new_blocks(999)
    assert 0 not in ids(blocks) and sorted(ids(blocks)) == list(range(1, 1000))
    assert pool.get_usage() == 1.0  # the usage formula leaves the null block out
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_check_3_decode_at_33_tokens_takes_no_new_block():
    mgr = make_manager(16, full_spec(16))
    req = make_request("r", range(32))
    # A prefill with one lookahead slot leaves the request with 32 computed tokens and 3 blocks.
    out, _ = admit(mgr, req, num_lookahead_tokens=1)
    assert len(out.blocks[0]) == 3 and req.num_computed_tokens == 32
    req.append_output_token_ids([1])
    # cdiv(32 + 1, 16) = 3 blocks needed, 3 held: 0 new.
    assert mgr.coordinator.get_num_blocks_to_allocate("r", 33, ([],)) == 0
    free_before = mgr.get_num_free_blocks()
    assert decode(mgr, req, 2).get_block_ids() == [[]]
    assert mgr.get_num_free_blocks() == free_before
    # A 4th block only when the request reaches 49 tokens.
    while req.num_computed_tokens + 1 < 49:
        assert decode(mgr, req, 3).num_new_blocks() == 0
    assert req.num_computed_tokens + 1 == 49
    assert decode(mgr, req, 4).num_new_blocks() == 1
    assert len(mgr.get_block_ids("r")[0]) == 4


def test_check_4_usage_stays_low_while_cached_blocks_are_evicted_and_hits_fall():
    """Usage counts only blocks outside the free queue; cached free blocks are in it and get evicted."""
    mgr = make_manager(11, full_spec(4), enable_kv_cache_events=True)  # 10 usable blocks
    long_running = make_request("L", [900, 901, 902], block_size=4)
    admit(mgr, long_running)
    assert mgr.get_usage() == pytest.approx(0.10)

    prompt = list(range(17))  # 4 full blocks + 1 token
    first = make_request("P1", prompt, block_size=4)
    admit(mgr, first)
    mgr.free(first)
    assert mgr.get_usage() == pytest.approx(0.10)
    assert mgr.get_computed_blocks(make_request("probe", prompt, block_size=4))[1] == 16

    probe = make_request("P2", prompt, block_size=4)
    _, hit_before = admit(mgr, probe)
    mgr.free(probe)
    rate_before = mgr.prefix_cache_stats.hits / mgr.prefix_cache_stats.queries
    assert hit_before == 16

    # One-off requests come and go; usage never leaves 0.10, yet they eat the cached prefix from the front.
    mgr.take_events()
    for i in range(20):
        q = make_request(f"Q{i}", [10_000 + 100 * i + j for j in range(9)], block_size=4)
        assert admit(mgr, q)[0] is not None
        mgr.free(q)
        assert mgr.get_usage() == pytest.approx(0.10)
        check_invariants(mgr)
    removed = {h for e in mgr.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert {external_block_hash(h) for h in probe.block_hashes} <= removed

    late = make_request("P3", prompt, block_size=4)
    assert mgr.get_usage() == pytest.approx(0.10)
    _, hit_after = admit(mgr, late)
    assert hit_after == 0
    rate_after = mgr.prefix_cache_stats.hits / mgr.prefix_cache_stats.queries
    assert rate_after < rate_before


def test_check_5_three_free_hits_plus_one_new_block_do_not_fit_in_three():
    mgr = make_manager(4, full_spec(16))  # exactly 3 usable blocks
    owner = make_request("A", range(48))
    admit(mgr, owner)
    mgr.free(owner)
    assert mgr.get_num_free_blocks() == 3
    assert all(b.ref_cnt == 0 and b.block_hash is not None for b in mgr.block_pool.blocks[1:])

    req = make_request("B", list(range(48)) + [99])
    hits, num_hit = mgr.get_computed_blocks(req)
    assert num_hit == 48 and len(hits.blocks[0]) == 3
    assert all(b.ref_cnt == 0 for b in hits.blocks[0])
    # 1 new block + 3 free hits = 4 > 3.
    assert mgr.coordinator.get_num_blocks_to_allocate("B", 49, hits.blocks) == 4

    before = snapshot(mgr)
    assert mgr.allocate_slots(req, 1, num_hit, hits, full_sequence_must_fit=True) is None
    assert snapshot(mgr) == before
    # The second check (without the admission gate) gives the same answer.
    assert mgr.allocate_slots(req, 1, num_hit, hits, full_sequence_must_fit=False) is None
    assert snapshot(mgr) == before
    assert mgr.get_block_ids("B") == [[]]
    check_invariants(mgr)


def test_check_5_fits_once_a_fourth_block_exists():
    # Contrast: with one more free block the same request is admitted and adopts all three hits.
    mgr = make_manager(5, full_spec(16))
    owner = make_request("A", range(48))
    admit(mgr, owner)
    mgr.free(owner)
    req = make_request("B", list(range(48)) + [99])
    out, hit = admit(mgr, req)
    assert hit == 48 and out is not None and out.num_new_blocks() == 1
    assert mgr.get_block_ids("B") == [[1, 2, 3, 4]]
    check_invariants(mgr)


def test_kv_cache_manager_is_importable_without_torch():
    import subprocess
    import sys

    code = (
        "import sys; import engine_core.kv_cache, engine_core.kv_cache.planning, engine_core.request; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0
    assert KVCacheManager  # imported above without torch
