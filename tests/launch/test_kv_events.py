"""KV events over real ZeroMQ sockets: the cached-block set rebuilt from events equals the ledger's."""

import random

import zmq

from engine_core.config import SchedulerConfig
from engine_core.core import EngineCore
from engine_core.kv_cache.block import get_block_hash, get_group_id
from engine_core.reference_executor import ReferenceExecutor
from launch.kv_events import KVEventPublisher, KVEventSubscriber
from protocol import AllBlocksCleared, BlockRemoved, BlockStored, EngineCoreRequest, FullAttentionSpec, SamplingParams

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)


COUNTS: dict[str, int] = {}  # events seen by kind, so the test can show every kind occurred


def apply(batches, cached: set) -> None:
    for batch in batches:
        for event in batch.events:
            COUNTS[type(event).__name__] = COUNTS.get(type(event).__name__, 0) + 1
            if isinstance(event, BlockStored):
                cached.update((h, event.group_id) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cached.difference_update((h, event.group_id) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                cached.clear()


def drain(sub: KVEventSubscriber, cached: set) -> None:
    while batches := sub.recv(timeout_ms=200):
        apply(batches, cached)
    apply(sub.catch_up(), cached)  # anything the live socket had not delivered yet


def ledger_cached_set(core: EngineCore) -> set:
    keys = core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block._map
    return {(get_block_hash(k), get_group_id(k)) for k in keys}


def test_cached_blocks_rebuilt_from_events_equal_the_ledger(tmp_path):
    executor = ReferenceExecutor(available_kv_bytes=[SPEC.page_size_bytes * 48], kv_cache_specs={"l0": SPEC})
    core = EngineCore(SchedulerConfig(max_model_len=128, max_num_batched_tokens=32, enable_kv_cache_events=True),
                      executor)
    ctx = zmq.Context()
    publisher = KVEventPublisher(ctx, f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay", buffer_steps=100_000)
    early = KVEventSubscriber(ctx, f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay")
    late = None
    rng = random.Random(1)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    early_set, late_set = set(), set()
    try:
        for i in range(40):
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            core.add_request(EngineCoreRequest(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 12)), 0.0))
            for _ in range(3):
                core.step()
                publisher.publish(core.take_kv_events())
                apply(early.recv(timeout_ms=0), early_set)
            if i == 20:  # joins halfway, misses everything before
                late = KVEventSubscriber(ctx, f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay")
            if late is not None:
                apply(late.recv(timeout_ms=0), late_set)
        while core.has_work():
            core.step()
            publisher.publish(core.take_kv_events())
        drain(early, early_set)
        drain(late, late_set)
        assert early_set == late_set == ledger_cached_set(core)
        assert core.scheduler.kv_cache_manager.reset_prefix_cache()
        for i in range(3):  # cache again after the clear
            core.add_request(EngineCoreRequest(f"again{i}", prefixes[i] + [1, 2], SamplingParams(max_tokens=2), 0.0))
        while core.has_work():
            core.step()
            publisher.publish(core.take_kv_events())
        drain(early, early_set)
        drain(late, late_set)
        expected = ledger_cached_set(core)
        assert expected  # the check below is not vacuous
        assert early_set == expected
        assert late_set == expected
        assert late.next_seq == early.next_seq == publisher.seq
        assert {"BlockStored", "BlockRemoved", "AllBlocksCleared"} <= set(COUNTS)
    finally:
        for sock in (early, late, publisher):
            if sock is not None:
                sock.close()
        ctx.term()
