"""cdiv and format_bytes: the one home of ceiling division and of byte counts in messages."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.sizes import cdiv, format_bytes


@given(st.integers(-10**6, 10**6), st.integers(1, 10**4))
def test_cdiv_is_the_ceiling(a, b):
    assert cdiv(a, b) == math.ceil(a / b) == (a + b - 1) // b


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1000, "1000 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (640 << 10, "640 KiB"),
        (65536, "64 KiB"),
        (3 << 19, "1.5 MiB"),
        (512 << 20, "512 MiB"),
        (int(3.2 * (1 << 30)), "3.2 GiB"),
        (int(5.74 * (1 << 30)), "5.7 GiB"),
        (3 << 40, "3 TiB"),
        (5000 << 40, "5000 TiB"),
        (-(1 << 20), "-1 MiB"),
        (-500, "-500 B"),
    ],
)
def test_format_bytes_picks_a_unit_where_the_number_says_something(n, text):
    assert format_bytes(n) == text
