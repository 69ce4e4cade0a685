"""Outputs of several tokens at once (speculative decoding): the same text and stop as one token at a time, and
the output ends at the token that completes a stop string."""

import pytest

from launch.api_server.detokenizer import IncrementalDetokenizer
from launch.api_server.text_model import TextModel, load_text_model
from tests.launch.text_support import smollm2_path

SENTENCE = "The capital of France is Paris, and of Japan is Tokyo. Café 日本語 done."


@pytest.fixture(scope="module")
def smollm2() -> TextModel:
    return load_text_model(str(smollm2_path()))


def _one_by_one(text: TextModel, ids: list[int], stop: list[str]) -> tuple[str, int]:
    detok = IncrementalDetokenizer(text.decode, text.encode("Say:"), stop)
    out = ""
    for n, t in enumerate(ids, 1):
        out += detok.add([t], final=n == len(ids))
        if detok.stopped:
            return out, n
    return out, len(ids)


@pytest.mark.parametrize("stop", [[], ["is Paris,"], ["Tokyo", "never"], ["日本"]])
@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_chunks_give_the_text_and_the_stop_of_single_tokens(smollm2, stop, chunk):
    ids = smollm2.encode(SENTENCE, add_special_tokens=False)
    expected, expected_taken = _one_by_one(smollm2, ids, stop)
    detok = IncrementalDetokenizer(smollm2.decode, smollm2.encode("Say:"), stop)
    text, taken = "", 0
    for start in range(0, len(ids), chunk):
        piece, n = detok.add_each(ids[start:start + chunk], final=start + chunk >= len(ids))
        text, taken = text + piece, taken + n
        if detok.stopped:
            break
    assert (text, taken) == (expected, expected_taken)
    assert taken < len(ids) if stop else taken == len(ids)
