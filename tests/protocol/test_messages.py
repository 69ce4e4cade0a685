"""Every wire message round-trips through the codec of its socket; anything else is a ProtocolError.

Sockets and their codecs:
  client -> engine core     client_codec            EngineCoreRequest | EngineCoreAbort
  engine core -> client     outputs_codec           EngineCoreOutputs
  engine core -> workers    engine_to_worker_codec  SchedulerOutput | InitKVCache | Shutdown | EngineHeartbeat
  workers -> engine core    worker_to_engine_codec  WorkerKVReport | WorkerReady | ModelRunnerOutput | WorkerError
                                                    | NodeHeartbeat
  KV events PUB             kv_events_codec         KVEventBatch
"""

import pickle

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import protocol
from protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachedRequestData,
    EngineCoreAbort,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FullAttentionSpec,
    InitKVCache,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVEventBatch,
    ModelRunnerOutput,
    NewRequestData,
    ProtocolError,
    SamplingParams,
    SchedulerOutput,
    Shutdown,
    SlidingWindowSpec,
    WorkerError,
    WorkerKVReport,
    WorkerReady,
)
from protocol.codec import (
    client_codec,
    engine_to_worker_codec,
    kv_events_codec,
    outputs_codec,
    worker_to_engine_codec,
)
from protocol.messages import EngineHeartbeat, NodeHeartbeat

CODECS = {
    "client": client_codec(),
    "outputs": outputs_codec(),
    "engine_to_worker": engine_to_worker_codec(),
    "worker_to_engine": worker_to_engine_codec(),
    "kv_events": kv_events_codec(),
}

# The names a decode error must mention for each socket: the type (or every member of the union) expected there.
EXPECTED_NAMES = {
    "client": ["EngineCoreRequest", "EngineCoreAbort", "EngineCoreGetStats"],
    "outputs": ["EngineCoreOutputs"],
    "engine_to_worker": ["SchedulerOutput", "InitKVCache", "Shutdown", "EngineHeartbeat"],
    "worker_to_engine": ["WorkerKVReport", "WorkerReady", "ModelRunnerOutput", "WorkerError", "NodeHeartbeat"],
    "kv_events": ["KVEventBatch"],
}



def kv_report(**kw) -> WorkerKVReport:
    kw.setdefault("vocab_size", 32000)
    return WorkerKVReport(**kw)


LLAMA_FULL = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2)
SLIDING = SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, dtype_bytes=2, sliding_window=4096)
MLA_LIKE = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=192, dtype_bytes=2, head_size_v=128)
SLIDING_V = SlidingWindowSpec(block_size=32, num_kv_heads=2, head_size=64, dtype_bytes=4, sliding_window=128, head_size_v=32)

FULL_SAMPLING = SamplingParams(
    max_tokens=128, temperature=0.7, top_k=50, top_p=0.9, seed=1234, stop_token_ids=[2, 13], ignore_eos=True
)
HYBRID_CONFIG = KVCacheConfig(
    num_blocks=4096,
    kv_cache_groups=[
        KVCacheGroupSpec(layer_names=["model.layers.0.self_attn", "model.layers.2.self_attn"], kv_cache_spec=LLAMA_FULL),
        KVCacheGroupSpec(layer_names=["model.layers.1.self_attn", "model.layers.3.self_attn"], kv_cache_spec=SLIDING),
    ],
)

# (socket, id, message): every message type, optional fields unset and set.
SAMPLES = [
    # ---- client -> engine core
    ("client", "request-defaults", EngineCoreRequest("r0", [1, 2, 3], SamplingParams(), 1.5)),
    (
        "client",
        "request-all-optional-set",
        EngineCoreRequest("r1", [5] * 40, FULL_SAMPLING, 1_700_000_000.25, cache_salt="tenant-a", priority=-3),
    ),
    # a None in the middle with a non-default after it (omit_defaults can only drop trailing defaults)
    ("client", "request-priority-only", EngineCoreRequest("r2", [7], SamplingParams(temperature=0.0), 0.0, priority=5)),
    ("client", "request-empty-salt", EngineCoreRequest("r3", [], SamplingParams(max_tokens=1), 2.0, cache_salt="")),
    ("client", "get-stats", protocol.EngineCoreGetStats()),
    ("client", "request-unicode-id", EngineCoreRequest("é-🚀-\x00", [0], SamplingParams(seed=0), 3.0)),
    ("client", "abort", EngineCoreAbort(["r0", "r1"])),
    ("client", "abort-empty", EngineCoreAbort([])),
    # ---- engine core -> client
    ("outputs", "outputs-empty", EngineCoreOutputs([])),
    (
        "outputs",
        "outputs-all-finish-reasons",
        EngineCoreOutputs(
            [
                EngineCoreOutput("running", [11, 12]),
                EngineCoreOutput("len", [13], finish_reason="length", num_cached_tokens=32),
                EngineCoreOutput("stop", [2], finish_reason="stop"),
                EngineCoreOutput("abort", [], finish_reason="abort"),
                EngineCoreOutput("err", [], finish_reason="error", error="prompt of 9000 tokens > max_model_len 8192"),
            ],
            timestamp=12.5,
        ),
    ),
    ("outputs", "outputs-with-stats", EngineCoreOutputs([EngineCoreOutput("r", [1])], 1.0, stats=protocol.SchedulerStats(
        num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25, prefix_cache_queries=100,
        prefix_cache_hits=40, num_preemptions=2, step=9))),
    # ---- engine core -> workers
    ("engine_to_worker", "sched-empty-step", SchedulerOutput(0, [], CachedRequestData(), {}, 0)),
    (
        "engine_to_worker",
        "sched-full",
        SchedulerOutput(
            step=7,
            scheduled_new_reqs=[
                NewRequestData("new", [1, 2, 3, 4, 5], [], SamplingParams(), [[1, 2], [3]], 0),
                # resuming after a preemption: output tokens replayed, prefix-cached tokens computed
                NewRequestData("resumed", [9] * 33, [4, 4], FULL_SAMPLING, [[5, 6, 7], [8]], 16),
            ],
            scheduled_cached_reqs=CachedRequestData(
                req_ids=["a", "b", "c"],
                new_block_ids=[None, [[10], []], [[11, 12], [13]]],
                num_computed_tokens=[17, 32, 64],
            ),
            num_scheduled_tokens={"new": 5, "resumed": 19, "a": 1, "b": 1, "c": 1},
            total_num_scheduled_tokens=27,
            finished_req_ids=["done"],
            preempted_req_ids=["victim"],
            block_table_digests={"new": b"\x00" * 8, "a": bytes(range(8))},
        ),
    ),
    (
        "engine_to_worker",
        "sched-empty-digests",
        SchedulerOutput(1, [], CachedRequestData(["x"], [None], [3]), {"x": 1}, 1, block_table_digests={}),
    ),
    ("engine_to_worker", "init-kv-cache-hybrid", InitKVCache(HYBRID_CONFIG)),
    (
        "engine_to_worker",
        "init-kv-cache-head-size-v",
        InitKVCache(KVCacheConfig(7, [KVCacheGroupSpec(["l0"], MLA_LIKE), KVCacheGroupSpec(["l1"], SLIDING_V)])),
    ),
    ("engine_to_worker", "init-kv-cache-no-groups", InitKVCache(KVCacheConfig(0, []))),
    ("engine_to_worker", "shutdown", Shutdown()),
    ("engine_to_worker", "shutdown-after-a-failure", Shutdown(error="worker rank 3 on host b (10.0.0.2) died")),
    ("engine_to_worker", "engine-heartbeat", EngineHeartbeat()),
    # ---- workers -> engine core
    (
        "worker_to_engine",
        "kv-report-both-specs",
        kv_report(
            rank=1,
            available_kv_bytes=60 * 2**30,
            kv_cache_specs={"l0": LLAMA_FULL, "l1": SLIDING, "l2": MLA_LIKE, "l3": SLIDING_V},
            eos_token_ids=[128001, 128009],
            max_position_embeddings=131072,
            memory_detail="total 80 GiB * 0.92 - weights 15 GiB - activations 2 GiB",
        ),
    ),
    ("worker_to_engine", "kv-report-defaults", kv_report(rank=0, available_kv_bytes=0, kv_cache_specs={}, eos_token_ids=[], max_position_embeddings=2048)),
    ("worker_to_engine", "ready", WorkerReady(rank=3, num_blocks=1000)),
    ("worker_to_engine", "runner-output", ModelRunnerOutput(7, ["a", "prefill-chunk", "b"], [[42], [], [1, 2]])),
    ("worker_to_engine", "runner-output-empty", ModelRunnerOutput(0, [], [])),
    ("worker_to_engine", "worker-error", WorkerError(rank=0, message="CUDA out of memory")),
    ("worker_to_engine", "node-heartbeat", NodeHeartbeat(node_rank=1, host="b (10.0.0.2)", tensor_parallel_size=4, nnodes=2)),
    ("worker_to_engine", "kv-report-with-host", kv_report(rank=2, available_kv_bytes=1 << 20, kv_cache_specs={},
                                                          eos_token_ids=[2], max_position_embeddings=64, host="b")),
    # ---- KV events
    (
        "kv_events",
        "kv-events-all-kinds",
        KVEventBatch(
            ts=99.0,
            events=[
                BlockStored([2**64 - 1, 2], None, list(range(32)), 16, None, "GPU", None, [("salt",), None], 0,
                            "full_attention"),
                BlockStored([3], 2, list(range(16)), 16, None, "GPU", None, [None], 1, "sliding_window", 4096),
                BlockStored([b"\x04" * 32], b"\x03" * 32, [1], 1, None, None, None),  # vLLM may send digests
                BlockRemoved([2**64 - 1], "GPU", group_idx=0),
                BlockRemoved([3], "GPU", group_idx=1),
                AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        ),
    ),
    ("kv_events", "kv-events-empty", KVEventBatch(0.0, [])),
]
SAMPLE_IDS = [s[1] for s in SAMPLES]


def assert_rejected(socket: str, data) -> ProtocolError:
    """Decoding must raise exactly ProtocolError naming the expected type(s); nothing else, nothing returned."""
    codec = CODECS[socket]
    try:
        result = codec.decode(data)
    except ProtocolError as e:
        err = e
    else:
        pytest.fail(f"{socket} codec accepted {bytes(data)!r} as {result!r}")
    assert isinstance(err, ValueError)  # ProtocolError is a ValueError
    for name in EXPECTED_NAMES[socket]:
        assert name in str(err), f"{err} does not name {name}"
    return err


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("socket,_id,msg", SAMPLES, ids=SAMPLE_IDS)
def test_round_trip_on_its_socket(socket, _id, msg):
    codec = CODECS[socket]
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    decoded = codec.decode(data)
    assert type(decoded) is type(msg)  # the union decodes to the right variant
    assert decoded == msg
    # also from the buffer types zmq hands out
    assert codec.decode(memoryview(data)) == msg
    assert codec.decode(bytearray(data)) == msg
    # encoding is deterministic
    assert codec.encode(decoded) == data


@pytest.mark.parametrize("socket,_id,msg", SAMPLES, ids=SAMPLE_IDS)
def test_wire_format_is_plain_msgpack(socket, _id, msg):
    """Any msgpack reader can read every message (no pickle, no ext types); structs travel as arrays
    (KV events are maps inside the batch array, as vLLM sends them)."""
    raw = msgspec.msgpack.decode(CODECS[socket].encode(msg))
    assert isinstance(raw, list)
    if socket not in ("outputs", "kv_events"):  # tagged unions: the tag is the first element
        assert raw[0] == type(msg).__name__


def test_all_message_types_are_covered():
    covered = {type(m).__name__ for _, _, m in SAMPLES}
    assert covered == {n for names in EXPECTED_NAMES.values() for n in names}


def test_optional_fields_unset_decode_to_defaults():
    codec = CODECS["client"]
    req = codec.decode(codec.encode(EngineCoreRequest("r", [1], SamplingParams(), 0.0)))
    assert req.cache_salt is None and req.priority == 0
    assert req.sampling_params == SamplingParams()
    out = CODECS["outputs"].decode(CODECS["outputs"].encode(EngineCoreOutputs([EngineCoreOutput("r", [1])])))
    o = out.outputs[0]
    assert (o.finish_reason, o.num_cached_tokens, o.error, out.timestamp) == (None, 0, None, 0.0)
    s = CODECS["engine_to_worker"].decode(CODECS["engine_to_worker"].encode(SchedulerOutput(0, [], CachedRequestData(), {}, 0)))
    assert s.finished_req_ids == [] and s.preempted_req_ids == [] and s.block_table_digests is None
    assert s.scheduled_cached_reqs == CachedRequestData([], [], [])


def test_decoded_defaults_are_not_shared():
    """Mutable defaults ([]) must be fresh per decoded message, or one message would leak into the next."""
    codec = CODECS["engine_to_worker"]
    data = codec.encode(SchedulerOutput(0, [], CachedRequestData(), {}, 0))
    a, b = codec.decode(data), codec.decode(data)
    a.finished_req_ids.append("x")
    a.scheduled_cached_reqs.req_ids.append("y")
    assert b.finished_req_ids == [] and b.scheduled_cached_reqs.req_ids == []


def test_kv_cache_config_spec_variants_survive():
    codec = CODECS["engine_to_worker"]
    msg = codec.decode(codec.encode(InitKVCache(HYBRID_CONFIG)))
    full, sliding = (g.kv_cache_spec for g in msg.kv_cache_config.kv_cache_groups)
    assert type(full) is FullAttentionSpec and type(sliding) is SlidingWindowSpec
    assert sliding.sliding_window == 4096
    assert full.page_size_bytes == 65536 and sliding.page_size_bytes == 32768
    # same numbers, different kind: never confused on the wire
    twin = FullAttentionSpec(16, 4, 128, 2)
    assert twin != SLIDING
    report = CODECS["worker_to_engine"].decode(
        CODECS["worker_to_engine"].encode(
            kv_report(rank=0, available_kv_bytes=1, kv_cache_specs={"a": twin, "b": SLIDING}, eos_token_ids=[], max_position_embeddings=1)
        )
    )
    assert type(report.kv_cache_specs["a"]) is FullAttentionSpec
    assert type(report.kv_cache_specs["b"]) is SlidingWindowSpec


def test_kv_event_kinds_survive():
    codec = CODECS["kv_events"]
    batch = {s[1]: s[2] for s in SAMPLES}["kv-events-all-kinds"]
    decoded = codec.decode(codec.encode(batch))
    assert [type(e) for e in decoded.events] == [BlockStored] * 3 + [BlockRemoved] * 2 + [AllBlocksCleared]
    assert decoded.events[0].parent_block_hash is None and decoded.events[0].block_hashes == [2**64 - 1, 2]
    assert decoded.events[0].extra_keys == [("salt",), None]
    assert decoded.events[1].parent_block_hash == 2 and decoded.events[1].group_idx == 1
    assert decoded.events[1].kv_cache_spec_sliding_window == 4096
    assert decoded.events[2].block_hashes == [b"\x04" * 32] and decoded.events[2].group_idx is None
    assert decoded.events[3].group_idx == 0


def test_kv_events_are_vllm_shaped():
    """The batch is an array [ts, events, rank]; each event a map tagged "type", defaults left out."""
    batch = {s[1]: s[2] for s in SAMPLES}["kv-events-all-kinds"]
    ts, events, rank = msgspec.msgpack.decode(CODECS["kv_events"].encode(batch))
    assert (ts, rank) == (99.0, 0)
    assert list(events[1]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                               "kv_cache_spec_sliding_window"]
    assert list(events[2]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name"]
    assert events[3] == {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": "GPU", "group_idx": 0}
    assert events[5] == {"type": "AllBlocksCleared"}
    assert msgspec.msgpack.decode(CODECS["kv_events"].encode(KVEventBatch(1.5, []))) == [1.5, [], None]  # arrays keep all


def test_codec_is_reusable_after_an_error():
    codec = CODECS["client"]
    good = codec.encode(SAMPLES[0][2])
    for bad in (b"", b"\xc1", good[:-1]):
        with pytest.raises(ProtocolError):
            codec.decode(bad)
        assert codec.decode(good) == SAMPLES[0][2]


# ---- hypothesis: random messages round-trip --------------------------------------------------

ids = st.text(max_size=12)
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=20)
block_lists = st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=6), max_size=3)
finite = st.floats(allow_nan=False, allow_infinity=False)

sampling_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 2**31 - 1),
    temperature=st.floats(0.0, 100.0),
    top_k=st.integers(0, 2**31 - 1),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    stop_token_ids=tokens,
    ignore_eos=st.booleans(),
)

engine_core_requests = st.builds(
    EngineCoreRequest,
    request_id=ids,
    prompt_token_ids=tokens,
    sampling_params=sampling_params,
    arrival_time=finite,
    cache_salt=st.none() | st.text(max_size=8),
    priority=st.integers(-(2**31), 2**31 - 1),
)

new_request_data = st.builds(
    NewRequestData,
    req_id=ids,
    prompt_token_ids=tokens,
    output_token_ids=tokens,
    sampling_params=sampling_params,
    block_ids=block_lists,
    num_computed_tokens=st.integers(0, 2**31),
)


@st.composite
def cached_request_data(draw):
    n = draw(st.integers(0, 5))
    return CachedRequestData(
        req_ids=draw(st.lists(ids, min_size=n, max_size=n)),
        new_block_ids=draw(st.lists(st.none() | block_lists, min_size=n, max_size=n)),
        num_computed_tokens=draw(st.lists(st.integers(0, 2**31), min_size=n, max_size=n)),
    )


scheduler_outputs = st.builds(
    SchedulerOutput,
    step=st.integers(0, 2**63 - 1),
    scheduled_new_reqs=st.lists(new_request_data, max_size=3),
    scheduled_cached_reqs=cached_request_data(),
    num_scheduled_tokens=st.dictionaries(ids, st.integers(0, 8192), max_size=5),
    total_num_scheduled_tokens=st.integers(0, 2**31),
    finished_req_ids=st.lists(ids, max_size=3),
    preempted_req_ids=st.lists(ids, max_size=3),
    block_table_digests=st.none() | st.dictionaries(ids, st.binary(min_size=8, max_size=8), max_size=4),
)

FAST = settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(scheduler_outputs)
def test_random_scheduler_outputs_round_trip(msg):
    codec = CODECS["engine_to_worker"]
    decoded = codec.decode(codec.encode(msg))
    assert type(decoded) is SchedulerOutput
    assert decoded == msg


@FAST
@given(engine_core_requests)
def test_random_engine_core_requests_round_trip(msg):
    codec = CODECS["client"]
    decoded = codec.decode(codec.encode(msg))
    assert type(decoded) is EngineCoreRequest
    assert decoded == msg


@FAST
@given(scheduler_outputs, st.data())
def test_random_scheduler_output_truncated_anywhere_is_rejected(msg, data):
    encoded = CODECS["engine_to_worker"].encode(msg)
    cut = data.draw(st.integers(0, len(encoded) - 1))
    assert_rejected("engine_to_worker", encoded[:cut])


# ---- malformed bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize("socket,_id,msg", SAMPLES, ids=SAMPLE_IDS)
def test_truncated_at_every_cut_point(socket, _id, msg):
    data = CODECS[socket].encode(msg)
    for cut in range(len(data)):  # includes the empty frame
        assert_rejected(socket, data[:cut])
        assert_rejected(socket, memoryview(data)[:cut])


@pytest.mark.parametrize("socket,_id,msg", SAMPLES, ids=SAMPLE_IDS)
def test_trailing_bytes_rejected(socket, _id, msg):
    data = CODECS[socket].encode(msg)
    assert_rejected(socket, data + b"\xc0")
    assert_rejected(socket, data + data)  # two messages glued into one frame


@pytest.mark.parametrize("socket,_id,msg", SAMPLES, ids=SAMPLE_IDS)
def test_message_of_another_socket_rejected(socket, _id, msg):
    data = CODECS[socket].encode(msg)
    for other in CODECS:
        if other != socket:
            assert_rejected(other, data)


@pytest.mark.parametrize("socket", list(CODECS))
def test_empty_frame_rejected(socket):
    err = assert_rejected(socket, b"")
    assert "0 bytes" in str(err)


GARBAGE = [
    b"\x00",
    b"\xc0",  # nil
    b"\xc1",  # never-used msgpack byte
    b"\xff" * 16,
    b"\x90",  # empty array
    b"\x80",  # empty map
    b"\xdd\xff\xff\xff\xff",  # array header claiming 4G elements, no body
    b"\xdb\xff\xff\xff\xff",  # str header claiming 4G bytes, no body
    b'{"request_id": "r", "prompt_token_ids": [1]}',  # JSON, not msgpack
    pickle.dumps({"request_id": "r"}),  # a pickle frame is just garbage here; never loaded
    pickle.dumps(EngineCoreAbort(["r"])),
    b"\x91" * 100_000 + b"\x90",  # very deep nesting
    msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"payload")),
    msgspec.msgpack.encode([msgspec.msgpack.Ext(-1, b"\x00" * 4)]),  # timestamp ext
    b"EngineCoreRequest",
]


@pytest.mark.parametrize("socket", list(CODECS))
@pytest.mark.parametrize("garbage", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_rejected(socket, garbage):
    assert_rejected(socket, garbage)


@FAST
@given(st.sampled_from(list(CODECS)), st.binary(max_size=96))
def test_random_bytes_never_escape_as_another_exception(socket, data):
    codec = CODECS[socket]
    try:
        msg = codec.decode(data)
    except ProtocolError as e:
        for name in EXPECTED_NAMES[socket]:
            assert name in str(e)
    else:  # random bytes that happen to be a valid message must be a whole, well-typed one
        assert type(msg).__name__ in EXPECTED_NAMES[socket]
        assert codec.decode(codec.encode(msg)) == msg


@FAST
@given(st.sampled_from(list(CODECS)), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5) | st.binary(max_size=5),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=3), c, max_size=3),
    max_leaves=12,
))
def test_random_msgpack_values_never_escape_as_another_exception(socket, value):
    try:
        data = msgspec.msgpack.encode(value)
    except OverflowError:  # ints beyond 64 bits have no msgpack form
        return
    codec = CODECS[socket]
    try:
        msg = codec.decode(data)
    except ProtocolError:
        return
    assert type(msg).__name__ in EXPECTED_NAMES[socket]


# Forged messages: right shape, wrong field types (or missing fields, or unknown tags).
_SP = []  # SamplingParams with every field at its default
STORED = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1], "block_size": 1,
          "lora_id": None, "medium": "GPU", "lora_name": None}

WRONG_TYPES = [
    ("client", "request_id-int", ["EngineCoreRequest", 7, [1], _SP, 0.0]),
    ("client", "token-str", ["EngineCoreRequest", "r", ["a"], _SP, 0.0]),
    ("client", "token-float", ["EngineCoreRequest", "r", [1.5], _SP, 0.0]),
    ("client", "tokens-not-list", ["EngineCoreRequest", "r", 1, _SP, 0.0]),
    ("client", "arrival-str", ["EngineCoreRequest", "r", [1], _SP, "now"]),
    ("client", "sampling-as-map", ["EngineCoreRequest", "r", [1], {"max_tokens": 5}, 0.0]),
    ("client", "max_tokens-bool", ["EngineCoreRequest", "r", [1], [True], 0.0]),
    ("client", "max_tokens-str", ["EngineCoreRequest", "r", [1], ["16"], 0.0]),
    ("client", "stop-not-list", ["EngineCoreRequest", "r", [1], [16, 1.0, 0, 1.0, None, 2], 0.0]),
    ("client", "ignore_eos-int", ["EngineCoreRequest", "r", [1], [16, 1.0, 0, 1.0, None, [], 1], 0.0]),
    ("client", "salt-bytes", ["EngineCoreRequest", "r", [1], _SP, 0.0, b"salt"]),
    ("client", "priority-float", ["EngineCoreRequest", "r", [1], _SP, 0.0, None, 1.5]),
    ("client", "missing-fields", ["EngineCoreRequest", "r", [1]]),
    ("client", "unknown-tag", ["EngineCoreGenerate", "r", [1], _SP, 0.0]),
    ("client", "tag-only", ["EngineCoreRequest"]),
    ("client", "as-map", {"type": "EngineCoreRequest", "request_id": "r"}),
    ("client", "abort-str", ["EngineCoreAbort", "r0"]),
    ("client", "abort-ids-int", ["EngineCoreAbort", [1, 2]]),
    ("outputs", "finish-int", [[["r", [1], 5]]]),
    ("outputs", "missing-new-tokens", [[["r"]]]),
    ("outputs", "output-not-struct", [["r"]]),
    ("outputs", "timestamp-str", [[], "noon"]),
    ("outputs", "cached-tokens-str", [[["r", [1], None, "3"]]]),
    ("outputs", "error-int", [[["r", [1], "error", 0, 500]]]),
    ("engine_to_worker", "block-ids-flat", ["SchedulerOutput", 1, [["r", [1], [], _SP, [1, 2], 0]], [], {}, 1]),
    ("engine_to_worker", "new-block-ids-flat", ["SchedulerOutput", 1, [], [["r"], [[1]], [0]], {}, 1]),
    ("engine_to_worker", "num-scheduled-list", ["SchedulerOutput", 1, [], [], [["r", 1]], 1]),
    ("engine_to_worker", "num-scheduled-str-value", ["SchedulerOutput", 1, [], [], {"r": "1"}, 1]),
    ("engine_to_worker", "digest-str", ["SchedulerOutput", 1, [], [], {}, 0, [], [], {"r": "digest"}]),
    ("engine_to_worker", "step-float", ["SchedulerOutput", -1.0, [], [], {}, 0]),
    ("engine_to_worker", "new-req-bad-sampling", ["SchedulerOutput", 1, [["r", [1], [], "greedy", [[1]], 0]], [], {}, 1]),
    ("engine_to_worker", "init-unknown-spec", ["InitKVCache", [10, [[["l0"], ["PagedSpec", 16, 8, 128, 2]]]]]),
    ("engine_to_worker", "init-spec-missing-field", ["InitKVCache", [10, [[["l0"], ["FullAttentionSpec", 16, 8]]]]]),
    ("engine_to_worker", "init-sliding-no-window", ["InitKVCache", [10, [[["l0"], ["SlidingWindowSpec", 16, 8, 128, 2]]]]]),
    ("engine_to_worker", "init-num-blocks-str", ["InitKVCache", ["10", []]]),
    ("engine_to_worker", "init-layer-names-str", ["InitKVCache", [10, [["l0", ["FullAttentionSpec", 16, 8, 128, 2]]]]]),
    ("engine_to_worker", "shutdown-tag-case", ["shutdown"]),
    ("worker_to_engine", "report-specs-list", ["WorkerKVReport", 0, 1, [["FullAttentionSpec", 16, 8, 128, 2]], [], 1]),
    ("worker_to_engine", "report-bytes-float", ["WorkerKVReport", 0, 1.5, {}, [], 1]),
    ("worker_to_engine", "ready-rank-str", ["WorkerReady", "0", 10]),
    ("worker_to_engine", "runner-flat-tokens", ["ModelRunnerOutput", 1, ["a"], [1]]),
    ("worker_to_engine", "runner-token-none", ["ModelRunnerOutput", 1, ["a"], [[None]]]),
    ("worker_to_engine", "error-message-none", ["WorkerError", 0, None]),
    ("kv_events", "hash-str", [0.0, [{**STORED, "block_hashes": ["h"]}]]),
    ("kv_events", "parent-str", [0.0, [{**STORED, "parent_block_hash": "p"}]]),
    ("kv_events", "stored-missing-lora-id", [0.0, [{k: v for k, v in STORED.items() if k != "lora_id"}]]),
    ("kv_events", "unknown-event", [0.0, [{"type": "BlockEvicted", "block_hashes": [1]}]]),
    ("kv_events", "removed-missing-medium", [0.0, [{"type": "BlockRemoved", "block_hashes": [1]}]]),
    ("kv_events", "event-as-array", [0.0, [["BlockRemoved", [1], "GPU"]]]),
    ("kv_events", "ts-str", ["0.0", []]),
    ("kv_events", "events-not-list", [0.0, {"type": "AllBlocksCleared"}]),
    ("kv_events", "rank-str", [0.0, [], "0"]),
]


@pytest.mark.parametrize("socket,_id,raw", WRONG_TYPES, ids=[w[1] for w in WRONG_TYPES])
def test_wrong_field_types_rejected(socket, _id, raw):
    assert_rejected(socket, msgspec.msgpack.encode(raw))


def test_error_points_at_the_bad_field():
    err = assert_rejected("client", msgspec.msgpack.encode(["EngineCoreRequest", "r", [1, "x"], [], 0.0]))
    assert "$[2][1]" in str(err)  # the path of the offending value, for the log line


def test_protocol_error_is_exported():
    assert protocol.ProtocolError is ProtocolError
    assert issubclass(ProtocolError, ValueError)


# ---- semantic checks beyond types ----


def test_unknown_finish_reason_rejected():
    assert_rejected("outputs", msgspec.msgpack.encode([[["r", [1], "exploded"]]]))


def test_cached_request_data_ragged_columns_rejected():
    assert_rejected("engine_to_worker", msgspec.msgpack.encode(["SchedulerOutput", 1, [], [["a", "b"], [None], []], {}, 2]))


def test_zero_sized_spec_rejected():
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        FullAttentionSpec(0, 1, 1, 1)
    forged = ["WorkerKVReport", 0, 100, {"l": ["FullAttentionSpec", 0, 0, 0, 0]}, [], 1, 1024]
    assert_rejected("worker_to_engine", msgspec.msgpack.encode(forged))
