"""Benchmark scripts, run from a checkout as `python -m bench.NAME` or `python bench/NAME.py`. Several drive the
worker or the engine core through the test suite's helpers (tests/), which are not installed: importing this package
puts the checkout's root on the path, so that a script run as a file finds them as a module run from the root does."""

import sys
from pathlib import Path

_CHECKOUT = str(Path(__file__).resolve().parents[1])
if _CHECKOUT not in sys.path:
    sys.path.append(_CHECKOUT)
