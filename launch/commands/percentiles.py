"""Latency percentiles, one method for `kvengine bench` and `kvengine simulate`: linear interpolation
between the closest ranks (statistics.quantiles' "inclusive" method, numpy's default)."""

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: int) -> float | None:
    """The q-th percentile (q in 1..99) of values in any order; None when there are none."""
    if not 1 <= q <= 99:
        raise ValueError(f"percentile {q} is not in 1..99")
    if len(values) < 2:
        return float(values[0]) if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]
