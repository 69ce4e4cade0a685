"""The n-gram proposer's rule (vLLM's prompt lookup) and the --speculative-config keys it is built from."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine_core.spec_decode.drafting import can_draft
from engine_core.spec_decode.ngram_proposer import NgramProposer
from protocol import SamplingParams
from protocol.config import engine_config
from protocol.speculative import parse_speculative_config


def test_longest_suffix_wins_and_proposes_what_followed_it():
    # suffix [7, 8, 9] occurred at 0 (followed by 1 2), [8, 9] alone at 5 (followed by 4): the longest wins
    tokens = [7, 8, 9, 1, 2, 8, 9, 4, 5, 7, 8, 9]
    assert NgramProposer(2, 1, 3).propose(tokens, 10) == [1, 2]
    assert NgramProposer(2, 1, 2).propose(tokens, 10) == [1, 2]  # [8, 9] first occurs at 1, followed by 1 2
    assert NgramProposer(3, 1, 2).propose([5, 8, 9, 3, 8, 9, 4, 8, 9], 10) == [3, 8, 9]  # the earliest occurrence


def test_bounds_and_caps():
    tokens = [1, 2, 3, 4, 5, 6, 3]  # only a 1-gram repeats
    assert NgramProposer(3, 2, 4).propose(tokens, 10) == []  # shorter than prompt_lookup_min
    assert NgramProposer(3, 1, 4).propose(tokens, 10) == [4, 5, 6]
    assert NgramProposer(3, 1, 4).propose(tokens, 2) == [4, 5]  # the scheduler's cap (budget, length)
    assert NgramProposer(3, 1, 4).propose(tokens, 0) == []
    assert NgramProposer(5, 1, 1).propose([4, 4], 10) == [4]  # what follows may be the suffix itself, then ends
    assert NgramProposer(3, 1, 3).propose([1, 2, 3, 4], 10) == []  # nothing repeats
    assert NgramProposer(3, 1, 3).propose([9], 10) == []


def _by_definition(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        for i in range(len(tokens) - n):  # earliest first, the suffix itself excluded
            if tokens[i : i + n] == tokens[len(tokens) - n :]:
                return tokens[i + n : i + n + k]
    return []


@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(1, 5), lo=st.integers(1, 3),
       extra=st.integers(0, 3), cap=st.integers(0, 6))
def test_proposals_follow_the_definition(tokens, k, lo, extra, cap):
    assert NgramProposer(k, lo, lo + extra).propose(tokens, cap) == _by_definition(tokens, min(k, cap), lo, lo + extra)


def test_config_keys_as_vllm_names_them():
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 3, 3)
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)


@pytest.mark.parametrize("text,named", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle'"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown key(s) model"),
    ('{"num_speculative_tokens": 2}', "method None"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
     "prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": "2"}', "num_speculative_tokens"),
    ("[1]", "JSON object"),
])
def test_bad_configs_are_refused_by_name_at_start_up(text, named):
    with pytest.raises(ValueError, match="speculative_config") as e:
        engine_config(speculative_config=text)
    assert named in str(e.value)


@pytest.mark.parametrize("params,outputs,drafts", [
    (SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1), 0, True),
    (SamplingParams(temperature=0.0), 0, True),
    (SamplingParams(seed=1), 0, False),
    (SamplingParams(logprobs=1), 0, False),
    (SamplingParams(repetition_penalty=1.1), 0, False),
    (SamplingParams(presence_penalty=0.5), 0, False),
    (SamplingParams(frequency_penalty=0.5), 0, False),
    (SamplingParams(logit_bias={3: 1.0}), 0, False),
    (SamplingParams(allowed_token_ids=[1, 2]), 0, False),
    (SamplingParams(bad_words_token_ids=[[1, 2]]), 0, False),
    (SamplingParams(min_tokens=3, max_tokens=8), 2, False),
    (SamplingParams(min_tokens=3, max_tokens=8), 3, True),  # past min_tokens nothing is barred
])
def test_only_exactly_verifiable_sampling_drafts(params, outputs, drafts):
    assert can_draft(params, outputs) is drafts
