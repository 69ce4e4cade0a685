"""The legacy completions logprobs object: each top_logprobs map holds the chosen token and the k most likely."""

from launch.api_server.logprobs import completion_logprobs
from protocol import TokenLogprobs


def show(token_id: int) -> str:
    return f"t{token_id}"


def test_a_chosen_token_outside_the_top_k_is_added_to_its_map():
    lp = TokenLogprobs(-2.5, [7, 8], [-0.5, -1.0], rank=3)  # sampled token 9, ranked 3rd
    out = completion_logprobs(show, [9], [lp], 0)
    assert out["top_logprobs"] == [{"t9": -2.5, "t7": -0.5, "t8": -1.0}]
    assert out["token_logprobs"] == [-2.5]


def test_a_chosen_token_among_the_top_k_appears_once():
    lp = TokenLogprobs(-0.5, [7, 8], [-0.5, -1.0])
    assert completion_logprobs(show, [7], [lp], 0)["top_logprobs"] == [{"t7": -0.5, "t8": -1.0}]


def test_logprobs_zero_gives_the_chosen_token_alone_and_an_echoed_first_token_null():
    lp = TokenLogprobs(-3.0)
    out = completion_logprobs(show, [1, 9], [None, lp], 4)
    assert out["top_logprobs"] == [None, {"t9": -3.0}]
    assert out["text_offset"] == [4, 6] and out["tokens"] == ["t1", "t9"]
