"""Token ids of the sampling controls past the model's vocabulary are refused by field name, before queueing."""

import pytest

from tests.engine_core.scheduler_support import VOCAB, assert_pool_empty, make_core, make_request, prompt_of


@pytest.mark.parametrize("field,value,outside", [
    ("logit_bias", {5: 1.0, VOCAB: -100.0}, VOCAB),
    ("allowed_token_ids", [1, 2, VOCAB + 7], VOCAB + 7),
    ("bad_words_token_ids", [[3], [4, VOCAB]], VOCAB),
])
def test_an_id_outside_the_vocabulary_is_refused_naming_the_field(field, value, outside):
    core, _ = make_core()
    rejected = core.add_request(make_request("r", prompt_of(1, 8), **{field: value}))
    assert rejected is not None and rejected.finish_reason == "error"
    assert rejected.error is not None
    assert rejected.error.startswith(f"{field} has token ids outside the vocabulary [0, {VOCAB})")
    assert rejected.error.endswith(f": {outside}")
    assert_pool_empty(core)


def test_ids_inside_the_vocabulary_are_accepted():
    core, _ = make_core()
    params = {"logit_bias": {VOCAB - 1: 2.0}, "allowed_token_ids": [0, VOCAB - 1], "bad_words_token_ids": [[1, 2]]}
    assert core.add_request(make_request("r", prompt_of(1, 8), **params)) is None


def test_the_error_names_at_most_five_ids():
    core, _ = make_core()
    rejected = core.add_request(make_request("r", prompt_of(1, 8), allowed_token_ids=list(range(VOCAB, VOCAB + 1000))))
    assert rejected is not None and rejected.error is not None
    assert rejected.error.endswith(f"{VOCAB + 4}, ...") and len(rejected.error) < 200


@pytest.mark.parametrize("sampling", [{"n": 2}, {"best_of": 3}, {"n": 2, "best_of": 2}])
def test_more_than_one_sequence_is_the_clients_to_fan_out(sampling):
    core, _ = make_core()
    rejected = core.add_request(make_request("r", prompt_of(1, 8), **sampling))
    assert rejected is not None and rejected.error is not None
    assert rejected.error.startswith(f"n={sampling.get('n', 1)}, best_of={sampling.get('best_of')}: the engine core")
    assert_pool_empty(core)
