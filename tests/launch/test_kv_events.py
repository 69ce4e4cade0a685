"""KV events over real ZeroMQ sockets: the cached-block set rebuilt from events equals the ledger's,
and a consumer built only on vLLM's schema and frames reads them, live and replayed."""

import random
from typing import Any

import msgspec
import zmq

from engine_core.core import EngineCore
from engine_core.executor.reference_executor import ReferenceExecutor
from engine_core.kv_cache.block import get_block_hash, get_group_id
from engine_core.kv_event_publisher import KVEventPublisher
from launch.client.kv_event_subscriber import KVEventSubscriber
from protocol import AllBlocksCleared, BlockRemoved, BlockStored, EngineCoreRequest, FullAttentionSpec, SamplingParams
from protocol.config import engine_config
from protocol.kv_cache_spec import SlidingWindowSpec
from protocol.kv_events import external_block_hash

SPEC = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)
SWA_SPEC = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2, sliding_window=8)


COUNTS: dict[str, int] = {}  # events seen by kind, so the test can show every kind occurred


def apply(batches, cached: set) -> None:
    for _seq, batch in batches:
        for event in batch.events:
            COUNTS[type(event).__name__] = COUNTS.get(type(event).__name__, 0) + 1
            if isinstance(event, BlockStored):
                cached.update((h, event.group_idx) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                cached.difference_update((h, event.group_idx) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                cached.clear()


def drain(sub: KVEventSubscriber, cached: set) -> None:
    while batches := sub.recv(timeout_ms=200):
        apply(batches, cached)
    apply(sub.catch_up(), cached)  # anything the live socket had not delivered yet


def ledger_keys(core: EngineCore) -> list[bytes]:
    return list(core.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block._map)


def ledger_cached_set(core: EngineCore) -> set:
    return {(external_block_hash(get_block_hash(k)), get_group_id(k)) for k in ledger_keys(core)}


def make_core(tmp_path, kv_cache_specs: dict) -> EngineCore:
    executor = ReferenceExecutor(available_kv_bytes=[SPEC.page_size_bytes * 48 * len(kv_cache_specs)],
                                 kv_cache_specs=kv_cache_specs)
    config = engine_config(max_model_len=128, max_num_batched_tokens=32, kv_events_endpoint=f"ipc://{tmp_path}/ev")
    return EngineCore(config, executor)


def test_cached_blocks_rebuilt_from_events_equal_the_ledger(tmp_path):
    core = make_core(tmp_path, {"l0": SPEC})
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


# ---- vLLM's side, written from vllm/distributed/kv_events.py: field order, types, defaults and
# struct options as vLLM declares them, tags by vLLM's class names. Stricter than vLLM in one way:
# unknown fields are refused, so the test also fails if we send a field vLLM does not have.


class VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list["VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared"]
    data_parallel_rank: int | None = None


class VllmKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True):
    pass


class VllmBlockStored(VllmKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(VllmKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(VllmKVCacheEvent, tag="AllBlocksCleared"):
    pass


VLLM_TOPIC = b"kv-events"  # the topic vLLM's docs subscribe to
VLLM_END_SEQ = (-1).to_bytes(8, "big", signed=True)


def vllm_block_hash(digest: bytes) -> int:
    """vLLM's default wire form of a block hash: the low 64 bits, big-endian."""
    return int.from_bytes(digest, "big") & (2**64 - 1)


def run_until_idle(core: EngineCore, publisher: KVEventPublisher, sub: zmq.Socket, live: dict) -> None:
    while core.has_work():
        core.step()
        publisher.publish(core.take_kv_events())
        while sub.poll(0):
            frames = sub.recv_multipart()
            assert len(frames) == 3 and frames[0] == VLLM_TOPIC and len(frames[1]) == 8
            live[int.from_bytes(frames[1], "big")] = frames[2]


def request_replay(dealer: zmq.Socket, start: int) -> list[tuple[int, bytes]]:
    """vLLM's replay exchange from a DEALER: [b"", start], then [b"", topic, seq, batch]... [b"", b"", END, b""]."""
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    while True:
        assert dealer.poll(10_000), "no answer from the replay socket"
        frames = dealer.recv_multipart()
        if frames == [b"", b"", VLLM_END_SEQ, b""]:
            return out
        assert len(frames) == 4 and frames[:2] == [b"", VLLM_TOPIC] and len(frames[2]) == 8, frames[:3]
        out.append((int.from_bytes(frames[2], "big"), frames[3]))


def test_a_consumer_built_on_vllms_schema_decodes_live_and_replayed_batches(tmp_path):
    core = make_core(tmp_path, {"l0": SPEC, "l1": SWA_SPEC})
    groups = core.scheduler.kv_cache_manager.coordinator.kv_cache_config.kv_cache_groups
    sliding_group = next(i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, SlidingWindowSpec))
    ctx = zmq.Context()
    publisher = KVEventPublisher(ctx, f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay", buffer_steps=100_000)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, VLLM_TOPIC)
    dealer = ctx.socket(zmq.DEALER)
    rng = random.Random(2)
    prefix = [rng.randrange(50) for _ in range(12)]
    live: dict[int, bytes] = {}

    def run(n: int, tag: str, salt: str | None = None) -> None:
        for i in range(n):
            prompt = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            core.add_request(EngineCoreRequest(f"{tag}{i}", prompt, SamplingParams(max_tokens=6), 0.0, cache_salt=salt))
        run_until_idle(core, publisher, sub, live)

    try:
        run(8, "before")  # nobody listens: these batches exist only in the replay buffer
        sub.connect(f"ipc://{tmp_path}/ev")
        dealer.connect(f"ipc://{tmp_path}/replay")
        for i in range(50):  # a SUB misses what is published before its subscription arrives
            run(1, f"join{i}")
            if live:
                break
        assert live, "the live socket delivered nothing"
        run(30, "pressure")  # enough to evict cached blocks
        run(2, "salted", salt="tenant-a")
        assert core.scheduler.kv_cache_manager.reset_prefix_cache()
        run(3, "after")
        while max(live) < publisher.seq - 1:  # the rest of the live frames
            assert sub.poll(10_000), "live frames stopped"
            _topic, seq, payload = sub.recv_multipart()
            live[int.from_bytes(seq, "big")] = payload

        dealer.send_multipart([b"", b"short"])  # malformed requests get no answer at all
        dealer.send(b"\x00" * 8)  # no delimiter
        replayed = request_replay(dealer, 0)
        assert [seq for seq, _ in replayed] == list(range(publisher.seq))
        assert set(live) == set(range(min(live), publisher.seq)) and min(live) > 0
        assert all(dict(replayed)[seq] == payload for seq, payload in live.items())  # replay = live, byte for byte
        assert [seq for seq, _ in request_replay(dealer, publisher.seq - 2)] == [publisher.seq - 2, publisher.seq - 1]

        decoder = msgspec.msgpack.Decoder(VllmKVEventBatch)
        cached: set = set()
        stored = removed = cleared = salted = 0
        for _, payload in replayed:
            batch = decoder.decode(payload)
            assert msgspec.msgpack.encode(batch) == payload  # exactly the bytes vLLM's structs would write
            assert batch.data_parallel_rank == 0 and batch.ts > 0 and batch.events
            for event in batch.events:
                if isinstance(event, VllmBlockStored):
                    stored += 1
                    assert (event.lora_id, event.lora_name, event.medium, event.block_size) == (None, None, "GPU", 4)
                    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event.block_hashes)
                    assert len(event.token_ids) == 4 * len(event.block_hashes)
                    assert event.extra_keys is not None and len(event.extra_keys) == len(event.block_hashes)
                    if event.group_idx == sliding_group:
                        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == ("sliding_window", 8)
                    else:
                        assert (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == ("full_attention", None)
                    if event.extra_keys[0] == ("tenant-a",):
                        salted += 1
                        assert event.parent_block_hash is None  # the salt is hashed into a request's first block
                    cached.update((h, event.group_idx) for h in event.block_hashes)
                elif isinstance(event, VllmBlockRemoved):
                    removed += 1
                    assert event.medium == "GPU"
                    cached.difference_update((h, event.group_idx) for h in event.block_hashes)
                else:
                    cleared += 1
                    cached.clear()
        assert stored and removed and cleared == 1 and salted
        expected = {(vllm_block_hash(get_block_hash(k)), get_group_id(k)) for k in ledger_keys(core)}
        assert expected and {g for _, g in expected} == {0, 1}
        assert cached == expected
    finally:
        sub.close()
        dealer.close()
        publisher.close()
        ctx.term()
