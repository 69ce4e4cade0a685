"""Shared set-up for the ledger tests: make the repo root and this folder importable.

The helpers themselves live in test_ledger_support.py (plain functions, importable from the
hypothesis state machine as well as from the example tests).
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
for _path in (_ROOT, _HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)
