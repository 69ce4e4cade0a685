"""Every bench/ script still starts: its imports resolve and `python -m bench.NAME --help` exits 0 (they are not
run in the suite). A script is a module of bench/ with a `__main__` block; bench/timing.py and bench/models.py are
helpers, not scripts."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "bench").glob("*.py") if 'if __name__ == "__main__":' in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_answers_help(script):
    module = f"bench.{script.removesuffix('.py')}"
    done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


def test_every_bench_module_is_a_script_or_a_helper():
    """A module left out of SCRIPTS is one of the known helpers, not a script that lost its __main__ block."""
    assert {p.name for p in (ROOT / "bench").glob("*.py")} - set(SCRIPTS) <= {"__init__.py", "timing.py", "models.py"}
