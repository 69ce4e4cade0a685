"""StructuredOutputsParams: exactly one kind, bounded sizes; refused on construction and when a peer sends it."""

import msgspec
import pytest

from protocol import EngineCoreRequest, ProtocolError, SamplingParams, StructuredOutputsParams
from protocol.codec import client_codec, engine_to_worker_codec
from protocol.structured_output import MAX_CHOICE_CHARS, MAX_CHOICES, MAX_SPEC_CHARS

INVALID = [
    ({}, "exactly one of json, json_object, regex, choice, grammar; got none"),
    ({"json": "{}", "regex": "a"}, "got json, regex"),
    ({"regex": "a", "json_object": True}, "got json_object, regex"),
    ({"choice": []}, "choice must not be empty"),
    ({"choice": ["a"] * (MAX_CHOICES + 1)}, "choice takes at most"),
    ({"choice": ["a" * (MAX_CHOICE_CHARS + 1)]}, "choice takes at most"),
    ({"grammar": "x" * (MAX_SPEC_CHARS + 1)}, "grammar has"),
]


@pytest.mark.parametrize("fields,message", INVALID, ids=[m for _, m in INVALID])
def test_refused_on_construction(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


@pytest.mark.parametrize("fields,message", INVALID[:4], ids=[m for _, m in INVALID[:4]])
def test_refused_from_a_peer(fields, message):
    """The wire form (array-like: json, regex, choice, grammar, json_object) with __post_init__ bypassed."""
    forged = [fields.get(k, None) for k in ("json", "regex", "choice", "grammar")] + [fields.get("json_object", False)]
    params = [16, 1.0, 0, 1.0, None, [], False, None, 0.0, 0.0, 1.0, 0.0, 0, {}, None, [], None, 1, None, forged]
    request = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], params, 0.0])
    with pytest.raises(ProtocolError, match="structured_outputs"):
        client_codec().decode(request)
    step = msgspec.msgpack.encode(["SchedulerOutput", 3, [["r", [1], [], params, [[1]], 0]], [], {"r": 1}, 1])
    with pytest.raises(ProtocolError, match="structured_outputs"):
        engine_to_worker_codec().decode(step)


@pytest.mark.parametrize("fields", [{"json": '{"type": "object"}'}, {"json_object": True}, {"regex": "[a-z]+"},
                                    {"choice": ["yes", "no"]}, {"grammar": 'start: "a"+'}])
def test_each_kind_round_trips(fields):
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**fields))
    codec = client_codec()
    request = codec.decode(codec.encode(EngineCoreRequest("r", [1], params, 0.0)))
    assert request.sampling_params == params
    assert request.sampling_params.structured_outputs.kind == next(iter(fields))
