"""EngineCoreRequest: id length, prompt length, arrival time and priority are bounded on construction and decode."""

import msgspec
import pytest

from protocol import EngineCoreRequest, ProtocolError, SamplingParams
from protocol.codec import client_codec
from protocol.messages import MAX_PRIORITY, MAX_PROMPT_TOKENS, MAX_REQUEST_ID_LENGTH, MIN_PRIORITY

NAN, INF = float("nan"), float("inf")
VALID = {"request_id": "r", "prompt_token_ids": [1, 2], "arrival_time": 0.0, "cache_salt": None, "priority": 0}

INVALID = [
    ("request_id", "x" * (MAX_REQUEST_ID_LENGTH + 1), "request_id has 257 characters, more than 256"),
    ("arrival_time", NAN, "arrival_time must be finite"),
    ("arrival_time", INF, "arrival_time must be finite"),
    ("arrival_time", -INF, "arrival_time must be finite"),
    ("priority", MAX_PRIORITY + 1, "priority must be in"),
    ("priority", MIN_PRIORITY - 1, "priority must be in"),
    ("priority", 2**64 - 1, "priority must be in"),
]


def fields(**override) -> list:
    """The request's fields in wire order (array_like), default sampling parameters in their place."""
    v = {**VALID, **override}
    return [v["request_id"], v["prompt_token_ids"], SamplingParams(), v["arrival_time"], v["cache_salt"], v["priority"]]


def wire(**override) -> bytes:
    """An EngineCoreRequest as a peer would send it, bypassing __post_init__."""
    return msgspec.msgpack.encode(["EngineCoreRequest", *fields(**override)])


def build(**override) -> EngineCoreRequest:
    return EngineCoreRequest(*fields(**override))


@pytest.mark.parametrize("field,value,message", INVALID, ids=lambda v: repr(v)[:30])
def test_out_of_range_refused_on_construction(field, value, message):
    with pytest.raises(ValueError, match=message):
        build(**{field: value})


@pytest.mark.parametrize("field,value,message", INVALID, ids=lambda v: repr(v)[:30])
def test_out_of_range_refused_on_decode(field, value, message):
    with pytest.raises(ProtocolError, match=message):
        client_codec().decode(wire(**{field: value}))


@pytest.mark.parametrize(
    "override",
    [
        {},
        {"request_id": "x" * MAX_REQUEST_ID_LENGTH},
        {"request_id": "é" * MAX_REQUEST_ID_LENGTH},  # characters, not bytes
        {"request_id": "line\nbreak"},  # accepted; logs escape it
        {"arrival_time": -1.5},
        {"priority": MIN_PRIORITY},
        {"priority": MAX_PRIORITY},
        {"prompt_token_ids": [0] * MAX_PROMPT_TOKENS},
    ],
    ids=lambda v: repr(v)[:40],
)
def test_edge_values_accepted_both_ways(override):
    req = build(**override)
    assert client_codec().decode(wire(**override)) == req


def test_a_longer_prompt_is_refused_on_construction_and_from_the_list_header():
    prompt = [0] * (MAX_PROMPT_TOKENS + 1)
    message = f"the prompt has {MAX_PROMPT_TOKENS + 1} tokens, more than {MAX_PROMPT_TOKENS}"
    with pytest.raises(ValueError, match=message):
        build(prompt_token_ids=prompt)
    with pytest.raises(ProtocolError, match=f"length <= {MAX_PROMPT_TOKENS}"):
        client_codec().decode(wire(prompt_token_ids=prompt))
