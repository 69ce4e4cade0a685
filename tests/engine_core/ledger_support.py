"""Helpers shared by the ledger tests (no tests in here).

Builders for specs/configs/requests, a full snapshot of the ledger's state (to show that a refused
allocate_slots changed nothing) and one checker for every ledger invariant of docs/architecture.md.
"""

from collections import Counter

from engine_core.kv_cache.block import get_block_hash, get_group_id, make_block_hash_with_group_id
from engine_core.kv_cache.hashing import get_hash_fn, get_request_block_hasher
from engine_core.kv_cache.manager import KVCacheManager
from engine_core.request import Request, RequestStatus
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, external_block_hash


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def full_spec(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype_bytes=2)


def swa_spec(block_size: int = 16, window: int = 32) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype_bytes=2, sliding_window=window)


def make_config(num_blocks: int, *specs) -> KVCacheConfig:
    """One KV cache group per spec given (default: one full-attention group of block size 16)."""
    specs = specs or (full_spec(),)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)],
    )


def make_manager(num_blocks: int, *specs, max_model_len: int = 4096, **kwargs) -> KVCacheManager:
    return KVCacheManager(make_config(num_blocks, *specs), max_model_len=max_model_len, **kwargs)


def make_request(request_id, token_ids, block_size: int = 16, cache_salt=None, hash_name: str = "sha256") -> Request:
    hasher = get_request_block_hasher(block_size, get_hash_fn(hash_name))
    return Request(str(request_id), list(token_ids), cache_salt=cache_salt, block_hasher=hasher)


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None, **kwargs):
    """What the scheduler's waiting pass does: look up the prefix hit, then allocate the rest (or a chunk)."""
    hits, num_hit = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    kwargs.setdefault("full_sequence_must_fit", True)
    out = manager.allocate_slots(request, num_new_tokens, num_hit, hits, **kwargs)
    if out is not None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit + num_new_tokens
    return out, num_hit


def decode(manager: KVCacheManager, request: Request, token: int = 7, **kwargs):
    """One decode step: the token sampled last step gets a slot, then the next token is appended."""
    out = manager.allocate_slots(request, 1, **kwargs)
    if out is not None:
        request.num_computed_tokens += 1
        request.append_output_token_ids([token])
    return out


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def queue_ids(pool) -> list[int]:
    return ids(pool.free_block_queue.get_all_free_blocks())


def hash_map_contents(pool) -> dict:
    """key -> sorted block ids registered under it."""
    out = {}
    for key, found in pool.cached_block_hash_to_block._map.items():
        blocks = found.values() if isinstance(found, dict) else [found]
        out[key] = sorted(b.block_id for b in blocks)
    return out


def snapshot(manager: KVCacheManager) -> dict:
    """Everything the ledger owns, as plain values."""
    pool = manager.block_pool
    return {
        "queue": queue_ids(pool),
        "num_free": pool.get_num_free_blocks(),
        "ref_cnt": [b.ref_cnt for b in pool.blocks],
        "hashes": [b.block_hash for b in pool.blocks],
        "map": hash_map_contents(pool),
        "req_to_blocks": [
            {rid: ids(blocks) for rid, blocks in m.req_to_blocks.items()}
            for m in manager.coordinator.single_type_managers
        ],
        "num_cached_block": [dict(m.num_cached_block) for m in manager.coordinator.single_type_managers],
        "events": len(pool.kv_event_queue),
        "stats": (
            manager.prefix_cache_stats.requests,
            manager.prefix_cache_stats.queries,
            manager.prefix_cache_stats.hits,
        ),
    }


def check_invariants(manager: KVCacheManager, requests: dict | None = None) -> None:
    """Every ledger invariant of docs/architecture.md. `requests`: the live requests by id (for hash checks)."""
    pool = manager.block_pool
    managers = manager.coordinator.single_type_managers
    queued = check_null_block_and_free_queue(pool)
    check_ref_counts(pool, managers, queued)
    check_hash_map(pool)
    if requests is not None:
        check_request_hashes(managers, requests)
    # Usage formula.
    assert abs(manager.get_usage() - (1 - pool.get_num_free_blocks() / (pool.num_gpu_blocks - 1))) < 1e-12


def check_null_block_and_free_queue(pool) -> set[int]:
    """Block 0 is the null block: never queued, never cached, never counted. The ids in the free queue."""
    null = pool.null_block
    assert null is pool.blocks[0] and null.is_null
    assert null.block_hash is None
    assert null.prev_free_block is None and null.next_free_block is None
    assert not any(b.is_null for b in pool.blocks[1:])

    queue = pool.free_block_queue.get_all_free_blocks()
    queued = {b.block_id for b in queue}
    assert len(queued) == len(queue), "a block is in the free queue twice"
    assert 0 not in queued
    assert len(queue) == pool.get_num_free_blocks()
    assert pool.num_cached_free_blocks == sum(b.block_hash is not None for b in queue)
    return queued


def check_ref_counts(pool, managers, queued: set[int]) -> None:
    """A non-null block is in the free queue iff ref_cnt == 0; free + in use == N - 1; ref_cnt == number of live
    (request, group) block lists holding the block."""
    in_use = 0
    for b in pool.blocks[1:]:
        assert b.ref_cnt >= 0
        assert (b.block_id in queued) == (b.ref_cnt == 0), b
        in_use += b.ref_cnt > 0
    assert pool.get_num_free_blocks() + in_use == pool.num_gpu_blocks - 1

    holders = Counter()
    for m in managers:
        for rid, blocks in m.req_to_blocks.items():
            seen = set()
            for b in blocks:
                if b.is_null:
                    # Only a sliding window puts the null block in a table.
                    assert type(m).__name__ == "SlidingWindowManager", (rid, m)
                    continue
                assert b.block_id not in seen, f"request {rid} holds block {b.block_id} twice"
                seen.add(b.block_id)
                holders[b.block_id] += 1
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders[b.block_id], (b, holders[b.block_id])


def check_hash_map(pool) -> None:
    """A block has a hash iff it is registered in the map under that hash + group."""
    registered = {}
    for key, block_ids in hash_map_contents(pool).items():
        assert block_ids, key
        for bid in block_ids:
            assert bid != 0
            assert pool.blocks[bid].block_hash == key, (bid, key)
            registered[bid] = key
    for b in pool.blocks:
        if b.block_hash is not None:
            assert registered.get(b.block_id) == b.block_hash, b
    if not pool.enable_caching:
        assert not registered


def check_request_hashes(managers, requests: dict) -> None:
    """A live request's cached block carries exactly the request's chained hash at that position."""
    for gid, m in enumerate(managers):
        for rid, blocks in m.req_to_blocks.items():
            req = requests[rid]
            for i, b in enumerate(blocks):
                if b.block_hash is not None:
                    assert i < len(req.block_hashes), (rid, i)
                    assert b.block_hash == make_block_hash_with_group_id(req.block_hashes[i], gid), (rid, gid, i)


class EventMirror:
    """Rebuilds the hash map's key counts from the KV events alone, to check the events are complete.
    Events carry the 64-bit wire form of a hash, so keys are (wire hash, group id)."""

    def __init__(self) -> None:
        self.keys = Counter()

    def apply(self, events) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self.keys[h, ev.group_idx] += 1
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    key = (h, ev.group_idx)
                    self.keys[key] -= 1
                    assert self.keys[key] >= 0, "BlockRemoved for a hash never stored"
                    if not self.keys[key]:
                        del self.keys[key]
            elif isinstance(ev, AllBlocksCleared):
                self.keys.clear()
            else:  # pragma: no cover
                raise TypeError(f"unknown event {ev!r}")

    def check(self, pool) -> None:
        expected: Counter = Counter()
        for k, v in hash_map_contents(pool).items():
            expected[external_block_hash(get_block_hash(k)), get_group_id(k)] += len(v)
        assert +self.keys == expected
