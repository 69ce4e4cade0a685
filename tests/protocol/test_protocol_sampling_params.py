"""SamplingParams: invalid values are refused on construction and when they arrive from a peer."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import EngineCoreRequest, ProtocolError, SamplingParams
from protocol.codec import client_codec, engine_to_worker_codec

NAN = float("nan")
INF = float("inf")
FIELDS = list(SamplingParams.__struct_fields__)
DEFAULTS = dict(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, seed=None, stop_token_ids=[], ignore_eos=False)

INVALID = [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", -(2**63)),
    ("temperature", -0.01),
    ("temperature", -1e-300),
    ("temperature", -INF),
    ("temperature", NAN),
    ("top_k", -1),
    ("top_p", 0.0),
    ("top_p", -0.0),
    ("top_p", -0.5),
    ("top_p", 1.0000001),
    ("top_p", 2.0),
    ("top_p", INF),
    ("top_p", NAN),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [5, 7, -2]),
]
INVALID_IDS = [f"{f}={v!r}" for f, v in INVALID]


def forged_params(**override) -> list:
    """SamplingParams as a peer would put it on the wire (array_like: field order), bypassing __post_init__."""
    values = {**DEFAULTS, **override}
    assert list(values) == FIELDS
    return list(values.values())


def test_field_order_is_what_forged_params_assume():
    assert FIELDS == list(DEFAULTS)


@pytest.mark.parametrize("field,value", INVALID, ids=INVALID_IDS)
def test_invalid_value_raises_on_construction(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("field,value", INVALID, ids=INVALID_IDS)
def test_invalid_value_from_peer_rejected_in_request(field, value):
    data = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1, 2], forged_params(**{field: value}), 0.0])
    with pytest.raises(ProtocolError) as ei:
        client_codec().decode(data)
    msg = str(ei.value)
    assert "EngineCoreRequest" in msg and field in msg


@pytest.mark.parametrize("field,value", INVALID, ids=INVALID_IDS)
def test_invalid_value_from_peer_rejected_in_new_request_data(field, value):
    new_req = ["r", [1], [], forged_params(**{field: value}), [[1]], 0]
    data = msgspec.msgpack.encode(["SchedulerOutput", 3, [new_req], [], {"r": 1}, 1])
    with pytest.raises(ProtocolError) as ei:
        engine_to_worker_codec().decode(data)
    assert "SchedulerOutput" in str(ei.value) and field in str(ei.value)


def test_forged_valid_params_decode():
    """The forging helper itself produces decodable bytes when values are valid (guards the tests above)."""
    data = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], forged_params(), 0.0])
    assert client_codec().decode(data).sampling_params == SamplingParams()


def test_peer_may_omit_trailing_defaults():
    data = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], [5], 0.0])
    assert client_codec().decode(data).sampling_params == SamplingParams(max_tokens=5)


VALID = [
    {},
    dict(max_tokens=1),
    dict(max_tokens=2**63 - 1),
    dict(temperature=0.0),
    dict(temperature=-0.0),
    dict(temperature=0),
    dict(temperature=1e-6),
    dict(temperature=100.0),
    dict(top_k=0),
    dict(top_k=1),
    dict(top_p=1.0),
    dict(top_p=5e-324),  # smallest positive float
    dict(top_p=0.5),
    dict(seed=0),
    dict(seed=-1),
    dict(seed=2**63 - 1),
    dict(stop_token_ids=[0]),
    dict(stop_token_ids=[0, 1, 128009]),
    dict(ignore_eos=True),
    dict(max_tokens=1, temperature=0.0, top_k=1, top_p=5e-324, seed=0, stop_token_ids=[0], ignore_eos=True),
]


@pytest.mark.parametrize("kw", VALID, ids=[repr(k) for k in VALID])
def test_valid_edge_values_accepted(kw):
    sp = SamplingParams(**kw)
    for k, v in kw.items():
        assert getattr(sp, k) == v
    codec = client_codec()
    req = EngineCoreRequest("r", [1], sp, 0.0)
    assert codec.decode(codec.encode(req)).sampling_params == sp
    # and the same values forged by a peer
    data = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], forged_params(**kw), 0.0])
    assert codec.decode(data).sampling_params == sp


def test_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=-0.0).greedy
    assert not SamplingParams().greedy
    assert not SamplingParams(temperature=1e-9).greedy


def test_error_messages_quote_the_value():
    with pytest.raises(ValueError, match="-3"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        SamplingParams(top_p=1.5)


@settings(max_examples=200, deadline=None)
@given(
    max_tokens=st.integers(-(2**63), 2**63 - 1),
    temperature=st.floats(),
    top_k=st.integers(-(2**31), 2**31),
    top_p=st.floats(),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**31), max_size=4),
)
def test_construction_and_decode_agree(max_tokens, temperature, top_k, top_p, stop_token_ids):
    """Whatever construction accepts, decoding accepts (and equal); whatever it refuses, decoding refuses."""
    kw = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, stop_token_ids=stop_token_ids)
    valid = (
        max_tokens >= 1
        and temperature >= 0.0
        and top_k >= 0
        and 0.0 < top_p <= 1.0
        and all(t >= 0 for t in stop_token_ids)
    )
    data = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], forged_params(**kw), 0.0])
    if valid:
        sp = SamplingParams(**kw)
        assert client_codec().decode(data).sampling_params == sp
    else:
        with pytest.raises(ValueError):
            SamplingParams(**kw)
        with pytest.raises(ProtocolError, match="EngineCoreRequest"):
            client_codec().decode(data)
