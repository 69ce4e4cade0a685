"""A user error at start-up is one line naming the problem, exit code 2, no traceback and no server started: a
make-model folder given a text prompt, a --model that does not exist, one that cannot be read."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from protocol.model.check import ModelPathError, check_model
from tests.e2e.conftest import wait_exit
from worker.model.tiny import write_model


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=300, check=False)


def one_line_refusal(proc: subprocess.CompletedProcess, command: str) -> str:
    """The one line a refused command printed (serve prints its flag errors on stdout), checked for shape."""
    out = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2 and len(out) == 1, proc.stdout + proc.stderr
    assert out[0].startswith(f"kvengine {command}: ")
    return out[0]


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    """What `kvengine make-model ./tiny-llama` writes: config.json and model.safetensors, no tokenizer."""
    proc = run_cli("make-model", "./tiny-llama", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return tmp_path / "tiny-llama"


def test_a_make_model_folder_given_a_text_prompt_is_one_line(tiny_folder, tmp_path):
    proc = run_cli("generate", "--model", "./tiny-llama", "--prompt", "Hello", cwd=tmp_path)
    line = one_line_refusal(proc, "generate")
    assert "./tiny-llama: no tokenizer.json" in line and "--prompt-token-ids" in line


def unreadable_models(folder: Path) -> dict[str, tuple[Path, str]]:
    """Name -> (a --model path that cannot be loaded, what its refusal says), made beside a good tiny folder."""
    root = folder.parent
    cases = {
        "missing": (root / "no-such-model", "no such file or folder"),
        "missing gguf": (root / "no-such-model.gguf", "no such file or folder"),
        "not a model file": (root / "notes.txt", "not a folder or a .gguf file"),
        "garbage gguf": (root / "garbage.gguf", "not a GGUF file"),
        "no config.json": (root / "no-config", "no config.json"),
        "config.json not JSON": (root / "bad-config", "config.json: not JSON"),
        "no weights": (root / "no-weights", "no *.safetensors weights"),
        "truncated weights": (root / "truncated", "model.safetensors: truncated"),
        "weights not safetensors": (root / "not-safetensors", "model.safetensors: not a safetensors file"),
    }
    (root / "notes.txt").write_text("a model\n")
    (root / "garbage.gguf").write_bytes(b"\x00" * 64)
    weights = (folder / "model.safetensors").read_bytes()
    for name, content in [("no-config", None), ("bad-config", "{"), ("no-weights", None), ("truncated", None),
                          ("not-safetensors", None)]:
        shutil.copytree(folder, root / name)
        if content is not None:
            (root / name / "config.json").write_text(content)
    (root / "no-config" / "config.json").unlink()
    (root / "no-weights" / "model.safetensors").unlink()
    (root / "truncated" / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    (root / "not-safetensors" / "model.safetensors").write_bytes(b"\xff" * 64)
    return cases


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_a_model_that_cannot_be_loaded_is_one_line_before_any_process_starts(tiny_folder, command):
    for name, (path, says) in unreadable_models(tiny_folder).items():
        extra = ["--prompt-token-ids", "1,2"] if command == "generate" else []
        line = one_line_refusal(run_cli(command, "--model", str(path), *extra, cwd=tiny_folder.parent), command)
        assert says in line and str(path.name) in line, (name, line)


def test_loadable_models_pass_the_check(tiny_folder):
    check_model(None)
    check_model(str(tiny_folder))
    check_model(str(write_model(tiny_folder.parent / "qwen2", "Qwen2ForCausalLM")))
    with pytest.raises(ModelPathError, match="no such file"):
        check_model(str(tiny_folder / "missing"))


def test_a_model_the_worker_refuses_still_ends_in_clear_lines(tiny_folder, start_server):
    """What the check cannot see (a weight missing from a well-formed file) fails in the worker: named, no traceback."""
    weights = load_file(tiny_folder / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tiny_folder / "model.safetensors")
    check_model(str(tiny_folder))
    server = start_server("--model", str(tiny_folder))
    assert wait_exit(server.proc, 300) == 1  # a liveness bound: the worker may build the CPU kernel first
    out = server.output()
    assert "worker rank 0 failed" in out and "model.norm.weight" in out and "Traceback" not in out, out
