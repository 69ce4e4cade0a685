"""ParentRequest: each child's parameters, and how its outputs come back under the parent."""

from launch.client import RequestOutput
from launch.client.parallel_sampling import ParentRequest
from protocol import SamplingParams, TokenLogprobs
from protocol.sampling import INT64_MAX, INT64_MIN


def test_children_take_one_sequence_and_their_own_seed():
    parent = ParentRequest("p", SamplingParams(n=3, seed=10, prompt_logprobs=2, temperature=0.5))
    kids = [parent.child_params(i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12]
    assert all(k.n == 1 and k.best_of is None and k.temperature == 0.5 for k in kids)
    assert [k.prompt_logprobs for k in kids] == [2, None, None]  # the others read the cache; child 0's are shared
    assert [parent.child_id(i) for i in range(3)] == ["0_p", "1_p", "2_p"]
    assert kids[0].logprobs is None  # n without best_of ranks nothing


def test_a_seed_near_the_top_wraps_within_int64():
    parent = ParentRequest("p", SamplingParams(n=3, seed=INT64_MAX - 1))
    assert [parent.child_params(i).seed for i in range(3)] == [INT64_MAX - 1, INT64_MAX, INT64_MIN]


def test_best_of_asks_for_the_sampled_tokens_logprobs_and_ranks_whole_sequences():
    parent = ParentRequest("p", SamplingParams(n=1, best_of=2))
    assert parent.child_params(1).logprobs == 0

    def out(index: int, token: int, logprob: float, finish: str | None) -> RequestOutput:
        return RequestOutput(parent.child_id(index), [token], finish, 0, logprobs=[TokenLogprobs(logprob)])

    assert parent.process(0, out(0, 5, -0.5, None)) == []
    assert parent.process(1, out(1, 6, -0.1, None)) == []
    assert parent.process(0, out(0, 7, -0.2, "length")) == []
    best = parent.process(1, out(1, 8, -0.9, "length"))  # cumulative -0.7 against -1.0
    assert len(best) == 1
    assert (best[0].request_id, best[0].index, best[0].new_token_ids) == ("p", 0, [5, 7])
    assert best[0].logprobs is None and best[0].finish_reason == "length"


def test_n_streams_each_output_under_the_parent_with_its_index_and_the_shared_prompt_logprobs():
    parent = ParentRequest("p", SamplingParams(n=2, prompt_logprobs=0))
    lps = [TokenLogprobs(-1.0)]
    first = parent.process(0, RequestOutput("0_p", [3], None, 0, prompt_logprobs=lps))
    other = parent.process(1, RequestOutput("1_p", [4], None, 16))
    later = parent.process(1, RequestOutput("1_p", [5], "stop", 16))
    assert [(o.request_id, o.index, o.new_token_ids) for o in first + other + later] == [
        ("p", 0, [3]), ("p", 1, [4]), ("p", 1, [5])]
    assert other[0].prompt_logprobs == lps and later[0].prompt_logprobs is None
