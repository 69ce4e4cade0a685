"""safe_for_log: client values in log lines are escaped and cut short."""

import pytest

from engine_core.safe_log import safe_for_log


def test_newlines_and_control_characters_are_escaped():
    text = safe_for_log("id\nWARNING forged line\r\x1b[31m")
    assert text == repr("id\nWARNING forged line\r\x1b[31m")
    assert "\n" not in text and "\r" not in text and "\x1b" not in text


@pytest.mark.parametrize("value", ["x" * 10_000, "\n" * 10_000, "é" * 500, b"\x00" * 1000, list(range(1000))])
def test_long_values_are_cut_to_the_limit_and_marked(value):
    text = safe_for_log(value, limit=50)
    assert len(text) == 50 and text.endswith("...")
    assert "\n" not in text


def test_short_values_are_whole():
    assert safe_for_log("abc") == "'abc'"
    assert safe_for_log(12) == "12"
    limit_exactly = "x" * 198  # its repr is 200 characters
    assert safe_for_log(limit_exactly) == repr(limit_exactly)
    assert safe_for_log("x" * 199).endswith("...")
