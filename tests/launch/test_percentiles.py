"""The one percentile method of bench and simulate: linear between the closest ranks."""

import pytest

from launch.commands.percentiles import percentile


def test_percentile_interpolates_between_ranks():
    assert percentile([4, 1, 3, 2], 50) == 2.5  # order does not matter
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([10.0, 20.0], 90) == pytest.approx(19.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="1..99"):
        percentile([1, 2], 100)
