"""SamplingParams: invalid values are refused on construction and when they arrive from a peer."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import EngineCoreRequest, ProtocolError, SamplingParams
from protocol.codec import client_codec, engine_to_worker_codec
from protocol.sampling import (
    GREEDY_TEMPERATURE,
    INT64_MAX,
    INT64_MIN,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_INT32,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID_ENTRIES,
    MIN_REPETITION_PENALTY,
)

NAN = float("nan")
INF = float("inf")
FIELDS = list(SamplingParams.__struct_fields__)
DEFAULTS = {
    "max_tokens": 16, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None, "stop_token_ids": [],
    "ignore_eos": False, "logprobs": None, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "repetition_penalty": 1.0, "min_p": 0.0, "min_tokens": 0, "logit_bias": {}, "allowed_token_ids": None,
    "bad_words_token_ids": [], "prompt_logprobs": None, "n": 1, "best_of": None, "structured_outputs": None,
}

INVALID = [
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", -(2**63)),
    ("max_tokens", MAX_INT32 + 1),
    ("max_tokens", 2**64 - 1),
    ("temperature", -0.01),
    ("temperature", -1e-300),
    ("temperature", -INF),
    ("temperature", NAN),
    ("temperature", INF),
    ("temperature", MAX_TEMPERATURE * 1.0001),
    ("top_k", -1),
    ("top_k", MAX_INT32 + 1),
    ("top_k", 2**63),  # overflowed torch.tensor in the worker
    ("top_k", 2**64 - 1),
    ("top_p", 0.0),
    ("top_p", -0.0),
    ("top_p", -0.5),
    ("top_p", 1.0000001),
    ("top_p", 2.0),
    ("top_p", INF),
    ("top_p", NAN),
    ("seed", INT64_MAX + 1),
    ("seed", 2**64 - 1),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [5, 7, -2]),
    ("stop_token_ids", [MAX_INT32 + 1]),
    ("stop_token_ids", [2**64 - 1]),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("presence_penalty", 2.0001),
    ("presence_penalty", -2.5),
    ("presence_penalty", NAN),
    ("frequency_penalty", -2.0001),
    ("frequency_penalty", INF),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", MIN_REPETITION_PENALTY / 2),
    ("repetition_penalty", MAX_REPETITION_PENALTY * 1.01),
    ("repetition_penalty", NAN),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("min_p", NAN),
    ("min_tokens", -1),
    ("min_tokens", 17),  # more than max_tokens (16)
    ("min_tokens", 2**63),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: -101.0}),
    ("logit_bias", {5: NAN}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {MAX_INT32 + 1: 1.0}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [3, -1]),
    ("allowed_token_ids", [2**40]),
    ("bad_words_token_ids", [[]]),
    ("bad_words_token_ids", [[1], [2, -3]]),
    ("bad_words_token_ids", [[MAX_INT32 + 1]]),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", MAX_LOGPROBS + 1),
    ("n", 0),
    ("n", MAX_N + 1),
    ("best_of", 0),
    ("best_of", MAX_N + 1),
]
INVALID_IDS = [f"{f}={v!r}" for f, v in INVALID]
# Values msgpack cannot carry, or refused by a type bound whose decode error names the limit, not the field
INVALID_ON_CONSTRUCTION = [
    ("seed", INT64_MIN - 1),
    ("stop_token_ids", [0] * (MAX_STOP_TOKEN_IDS + 1)),
    ("logit_bias", dict.fromkeys(range(MAX_TOKEN_ID_ENTRIES + 1), 1.0)),
    ("allowed_token_ids", [0] * (MAX_TOKEN_ID_ENTRIES + 1)),
    ("bad_words_token_ids", [[1]] * (MAX_BAD_WORDS + 1)),
    ("bad_words_token_ids", [[1] * (MAX_BAD_WORD_TOKENS + 1)]),
]


def forged_params(**override) -> list:
    """SamplingParams as a peer would put it on the wire (array_like: field order), bypassing __post_init__."""
    values = {**DEFAULTS, **override}
    assert list(values) == FIELDS
    return list(values.values())


def test_field_order_is_what_forged_params_assume():
    assert list(DEFAULTS) == FIELDS


@pytest.mark.parametrize("field,value", INVALID + INVALID_ON_CONSTRUCTION, ids=lambda v: repr(v)[:40])
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
    {"max_tokens": 1},
    {"max_tokens": MAX_INT32},
    {"temperature": 0.0},
    {"temperature": -0.0},
    {"temperature": 0},
    {"temperature": 1e-6},
    {"temperature": MAX_TEMPERATURE},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": MAX_INT32},
    {"top_p": 1.0},
    {"top_p": 5e-324},  # smallest positive float
    {"top_p": 0.5},
    {"seed": 0},
    {"seed": -1},
    {"seed": INT64_MAX},
    {"seed": INT64_MIN},
    {"stop_token_ids": [0]},
    {"stop_token_ids": [0, 1, 128009]},
    {"stop_token_ids": [MAX_INT32] * MAX_STOP_TOKEN_IDS},
    {"ignore_eos": True},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0},
    {"repetition_penalty": MIN_REPETITION_PENALTY},
    {"repetition_penalty": MAX_REPETITION_PENALTY},
    {"min_p": 1.0},
    {"prompt_logprobs": 0},
    {"n": MAX_N},
    {"n": 3, "best_of": 3},
    {"best_of": MAX_N},
    {"prompt_logprobs": MAX_LOGPROBS},
    {"min_tokens": 16},
    {"logit_bias": {0: -100.0, MAX_INT32: 100.0, 7: 0}},
    {"allowed_token_ids": [0, MAX_INT32]},
    {"bad_words_token_ids": [[1], [MAX_INT32] * MAX_BAD_WORD_TOKENS]},
    {
        "max_tokens": 1, "temperature": 0.0, "top_k": 1, "top_p": 5e-324, "seed": 0, "stop_token_ids": [0],
        "ignore_eos": True,
    },
]


@pytest.mark.parametrize("kw", VALID, ids=[repr(k)[:60] for k in VALID])
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


def test_best_of_is_at_least_n():
    with pytest.raises(ValueError, match=r"best_of must be in \[4, 128\], got 2"):
        SamplingParams(n=4, best_of=2)
    assert SamplingParams(n=2, best_of=5).num_sequences == 5
    assert SamplingParams(n=3).num_sequences == 3


def test_greedy():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=-0.0).greedy
    assert SamplingParams(temperature=1e-300).greedy  # would be 0 in the worker's float32 tensor
    assert not SamplingParams().greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_error_messages_quote_the_value():
    with pytest.raises(ValueError, match="-3"):
        SamplingParams(max_tokens=-3)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"top_k must be in \[0, 2147483647\], got 9223372036854775808"):
        SamplingParams(top_k=2**63)


def test_too_many_stop_ids_names_the_limit_and_never_quotes_the_list():
    with pytest.raises(ValueError, match=f"more than the limit of {MAX_STOP_TOKEN_IDS}") as ei:
        SamplingParams(stop_token_ids=[7] * 2_000_000)
    assert len(str(ei.value)) < 100
    with pytest.raises(ValueError, match="got -1$"):
        SamplingParams(stop_token_ids=[1] * 1000 + [-1])


@pytest.mark.parametrize("field,value,limit", [
    ("logit_bias", dict.fromkeys(range(MAX_TOKEN_ID_ENTRIES + 1), 1.0), MAX_TOKEN_ID_ENTRIES),
    ("allowed_token_ids", [7] * (MAX_TOKEN_ID_ENTRIES + 1), MAX_TOKEN_ID_ENTRIES),
    ("bad_words_token_ids", [[7]] * (MAX_BAD_WORDS + 1), MAX_BAD_WORDS),
    ("bad_words_token_ids", [[7] * (MAX_BAD_WORD_TOKENS + 1)], MAX_BAD_WORD_TOKENS),
], ids=["logit_bias", "allowed_token_ids", "bad_words", "bad_word_length"])
def test_long_id_lists_and_maps_are_refused_by_count_on_construction_and_from_their_header(field, value, limit):
    with pytest.raises(ValueError, match=f"more than the limit of {limit}") as ei:
        SamplingParams(**{field: value})
    assert len(str(ei.value)) < 120
    data = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], forged_params(**{field: value}), 0.0])
    with pytest.raises(ProtocolError, match=f"length <= {limit}"):
        client_codec().decode(data)


def test_decode_refuses_a_long_stop_id_list_from_its_header():
    """The type bound fires on the array header, so the 2M entries are never built into a list."""
    data = msgspec.msgpack.encode(["EngineCoreRequest", "r", [1], forged_params(stop_token_ids=[7] * 2_000_000), 0.0])
    with pytest.raises(ProtocolError, match=f"length <= {MAX_STOP_TOKEN_IDS}"):
        client_codec().decode(data)


@settings(max_examples=200)
@given(
    max_tokens=st.integers(-(2**63), 2**64 - 1),  # anything msgpack can carry
    temperature=st.floats(),
    top_k=st.integers(-(2**63), 2**64 - 1),
    top_p=st.floats(),
    seed=st.none() | st.integers(-(2**63), 2**64 - 1),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**32), max_size=4),
)
def test_construction_and_decode_agree(max_tokens, temperature, top_k, top_p, seed, stop_token_ids):
    """Whatever construction accepts, decoding accepts (and equal); whatever it refuses, decoding refuses."""
    kw = {
        "max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
        "stop_token_ids": stop_token_ids,
    }
    valid = (
        1 <= max_tokens <= MAX_INT32
        and 0.0 <= temperature <= MAX_TEMPERATURE
        and 0 <= top_k <= MAX_INT32
        and 0.0 < top_p <= 1.0
        and (seed is None or INT64_MIN <= seed <= INT64_MAX)
        and all(0 <= t <= MAX_INT32 for t in stop_token_ids)
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
