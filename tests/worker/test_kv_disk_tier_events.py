"""KV events of the disk tier over real ZeroMQ sockets: a subscriber sees BlockStored with medium "DISK" for each
block once it is on disk and BlockRemoved "DISK" for each block the bounded tier drops, so the set it rebuilds
from the events is what the tier's index holds; the memory tier's events keep medium "GPU"."""

import zmq

from engine_core.core import EngineCore
from engine_core.kv_event_publisher import KVEventPublisher
from launch.client.kv_event_subscriber import KVEventSubscriber
from protocol import BlockRemoved, BlockStored, EngineCoreRequest
from protocol.kv_events import MEDIUM_DISK, MEDIUM_GPU, external_block_hash
from protocol.kv_store.index import BlockIndex
from tests.worker.kv_disk_support import BLOCK, GREEDY, PREFIX, block_files, make_engine, served_once, tier_dir


def step_and_publish(engine: EngineCore, publisher: KVEventPublisher, prompts: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        engine.add_request(EngineCoreRequest(rid, prompt, GREEDY, 0.0))
    while engine.has_work():
        for out in engine.step().outputs:
            assert out.error is None, out.error
        publisher.publish(engine.take_kv_events())


def collect(sub: KVEventSubscriber) -> list:
    events = []
    while batches := sub.recv(timeout_ms=200):
        events += [e for _, batch in batches for e in batch.events]
    return events + [e for _, batch in sub.catch_up() for e in batch.events]


def rebuild(events: list, medium: str) -> set[int]:
    held: set[int] = set()
    for event in events:
        if isinstance(event, BlockStored) and event.medium == medium:
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved) and event.medium == medium:
            held.difference_update(event.block_hashes)
    return held


def test_a_subscriber_sees_the_tiers_stores_and_removals(tmp_path):
    served_once(tmp_path / "probe", {"p": PREFIX[:BLOCK] + [1]})
    (probe,) = block_files(tmp_path / "probe")  # one block's file: size the tier to ten of them
    ctx = zmq.Context()
    ev, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    publisher = KVEventPublisher(ctx, ev, replay, buffer_steps=100_000)
    sub = KVEventSubscriber(ctx, ev, replay)
    engine = make_engine(tmp_path / "tier", kv_events_endpoint=ev, kv_disk_bytes=10 * probe.stat().st_size)
    try:
        step_and_publish(engine, publisher, {"a": PREFIX + [5, 6, 7]})  # 6 blocks
        step_and_publish(engine, publisher, {"b": [9] * (8 * BLOCK + 1)})  # 8 more: 4 of a's go
        (tier,) = engine.get_tier_stats()
    finally:
        engine.shutdown()
        events = collect(sub)
        sub.close()
        publisher.close()
        ctx.term()
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_DISK]
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_DISK for h in e.block_hashes]
    assert sum(len(e.block_hashes) for e in stored) == tier.saved_blocks == 14
    assert len(removed) == tier.removed_blocks == 4
    index = BlockIndex(str(tier_dir(tmp_path / "tier") / "index.sqlite"))
    try:
        on_disk = {external_block_hash(key[:-4]) for (key,) in index.db.execute("SELECT key FROM blocks")}
    finally:
        index.close()
    assert rebuild(events, MEDIUM_DISK) == on_disk and len(on_disk) == 10
    first = next(e for e in stored if e.parent_block_hash is None and e.token_ids == PREFIX[:BLOCK])
    assert first.block_size == BLOCK and first.group_idx == 0 and first.kv_cache_spec_kind == "full_attention"
    memory = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_GPU]
    assert rebuild(memory, MEDIUM_GPU) >= on_disk  # the memory tier computed them first, under its own medium
