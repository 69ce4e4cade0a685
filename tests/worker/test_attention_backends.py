"""Which attention the runner uses: the C++ kernel on CPU where it builds, the torch path otherwise."""

import subprocess
import sys

import pytest
import torch

from worker.attention_backends import resolve_backend, triton_missing


def test_auto_picks_the_kernel_on_cpu_and_torch_is_kept_when_asked():
    assert resolve_backend("auto", torch.device("cpu")) == "cpu"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"


def test_auto_on_cuda_is_triton_where_it_imports_and_cpu_there_is_refused():
    assert resolve_backend("auto", torch.device("cuda")) == ("torch" if triton_missing() else "triton")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend("cpu", torch.device("cuda"))


def test_without_a_compiler_auto_falls_back_and_cpu_is_one_clear_error(tmp_path):
    """A fresh process with no cached build and no compiler: auto serves on the torch path, cpu refuses."""
    code = (
        "import torch; from worker.attention_backends import resolve_backend, triton_missing;"
        "print(resolve_backend('auto', torch.device('cpu')));"
        "resolve_backend('cpu', torch.device('cpu'))"
    )
    env = {"PATH": "/usr/bin:/bin", "CXX": "no-such-compiler-here", "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.stdout.strip() == "torch"
    assert "Attention falls back to the torch path: no C++ compiler" in done.stderr
    assert "ValueError: --attention-backend cpu: no C++ compiler" in done.stderr

