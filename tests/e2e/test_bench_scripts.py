"""Every bench/ script still starts: its imports resolve and `python -m bench.NAME --help` exits 0, and so does
`python bench/NAME.py --help` from another folder (they are not run in the suite). A script is a module of bench/
with a `__main__` block; bench/timing.py and bench/models.py are helpers, not scripts."""

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


@pytest.mark.parametrize("script", SCRIPTS)
def test_bench_script_runs_as_a_file(script, tmp_path):
    """`python bench/NAME.py`, as the issues quote them, from another folder: bench's modules are found."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


@pytest.mark.parametrize("with_bench", [True, False])
def test_a_script_run_as_a_file_finds_the_test_helpers(with_bench, tmp_path):
    """Several scripts import tests/ helpers only when they run (step_profile's Driver): with bench/ first on the
    path, as for a file in it, importing bench makes tests/ importable; without it they are not (the control)."""
    code = (f"import sys; sys.path[0] = {str(ROOT / 'bench')!r}; " + ("import bench; " if with_bench else "")
            + "import tests.worker.harness, tests.e2e.netns, tests.conformance.decisions")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False)
    if with_bench:
        assert done.returncode == 0, done.stderr[-2000:]
    else:
        assert "No module named 'tests'" in done.stderr


def test_every_bench_module_is_a_script_or_a_helper():
    """A module left out of SCRIPTS is one of the known helpers, not a script that lost its __main__ block."""
    assert {p.name for p in (ROOT / "bench").glob("*.py")} - set(SCRIPTS) <= {"__init__.py", "timing.py", "models.py"}
