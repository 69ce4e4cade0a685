"""The CPU kernels' build folder: named by the sources, flags and toolchain, shared by checkouts with the same
sources (never relinked by one of them), built by one process while the others wait, and reused after."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from worker.ops import cpu_build
from worker.ops.cpu_attention import CpuAttentionUnavailable, load_extension

ROOT = Path(__file__).resolve().parents[2]
LOAD = ("import logging; logging.basicConfig(level=logging.INFO);"
        "from worker.ops.cpu_attention import load_extension; load_extension()")


def checkout_copy(path: Path) -> Path:
    """Another checkout: the worker package copied elsewhere (same sources, other paths)."""
    shutil.copytree(ROOT / "worker", path / "worker", ignore=shutil.ignore_patterns("__pycache__"))
    return path


def start_load(cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.Popen:
    """load_extension() in a fresh interpreter, importing the worker package of the checkout at cwd."""
    return subprocess.Popen([sys.executable, "-c", LOAD], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)


def load_log(proc: subprocess.Popen) -> str:
    _, log = proc.communicate()
    assert proc.returncode == 0, log
    return log


def folder_in(log: str) -> str:
    """The build folder that the final log line names."""
    line = next(line for line in log.splitlines() if "CPU paged attention: " in line)
    return line.rsplit("(", 1)[1].rstrip(")")


def this_folder() -> Path:
    return cpu_build.build_directory(*cpu_build.build_inputs())


def test_the_folder_follows_every_input_of_the_build():
    files, cflags, toolchain = cpu_build.build_inputs()
    assert set(files) == {path.name for path in cpu_build.OPS_DIR.glob("*.[ch]*") if path.suffix in (".cpp", ".h")}
    assert cpu_build.build_directory(dict(files), list(cflags), list(toolchain)) == this_folder()
    compiler, version, torch_path, torch_version, python_include = toolchain
    variants = [
        ({**files, "module.cpp": files["module.cpp"] + b"// edited\n"}, cflags, toolchain),
        ({**files, "cpu_vec.h": files["cpu_vec.h"] + b"// edited\n"}, cflags, toolchain),
        (files, [*cflags, "-DEXTRA"], toolchain),
        (files, cflags, ["/usr/bin/clang++", version, torch_path, torch_version, python_include]),
        (files, cflags, [compiler, "g++ (other) 99.0", torch_path, torch_version, python_include]),
        (files, cflags, [compiler, version, "/other/venv/torch", torch_version, python_include]),
        (files, cflags, [compiler, version, torch_path, "2.99.0+cpu", python_include]),
    ]
    folders = {cpu_build.build_directory(*variant) for variant in variants}
    assert len(folders) == len(variants) and this_folder() not in folders


def test_a_second_process_loads_the_cached_build():
    load_extension()
    log = load_log(start_load())
    assert "loaded the cached build" in log and "building the CPU attention kernel" not in log


def test_another_checkout_with_the_same_sources_loads_the_same_build(tmp_path):
    """Before, the build folder ran ninja on this checkout's source paths, so each checkout relinked it."""
    load_extension()
    built = (this_folder() / "kvengine_paged_attention.so").stat().st_mtime_ns
    log = load_log(start_load(checkout_copy(tmp_path)))
    assert "loaded the cached build" in log and folder_in(log) == str(this_folder())
    assert (this_folder() / "kvengine_paged_attention.so").stat().st_mtime_ns == built
    assert "loaded the cached build" in load_log(start_load())  # and this checkout still finds it built


def test_a_build_lock_left_by_a_killed_build_is_removed():
    load_extension()
    lock = this_folder() / "lock"
    lock.touch()  # as torch leaves it when its builder is killed mid-compile: a fresh one, nobody holding it
    log = load_log(start_load())
    assert "removing the build lock a killed build left" in log
    assert "loaded the cached build" in log
    assert not lock.exists()


def test_a_missing_compiler_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(CpuAttentionUnavailable, match="no C\\+\\+ compiler: 'no-such-compiler-here'"):
        cpu_build.build_extension()


def test_two_checkouts_starting_at_once_build_once(tmp_path):
    """An empty cache: one process says it builds and where, the other waits and loads that build."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler here")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    procs = [start_load(ROOT, env), start_load(checkout_copy(tmp_path / "other"), env)]
    logs = [load_log(proc) for proc in procs]
    builders = [log for log in logs if "building the CPU attention kernel, about" in log]
    assert len(builders) == 1 and "CPU paged attention: compiled" in builders[0]
    (loader,) = [log for log in logs if log is not builders[0]]
    assert "loaded the cached build" in loader and "building the CPU attention kernel" not in loader
    assert folder_in(logs[0]) == folder_in(logs[1])
    assert folder_in(logs[0]).startswith(str(tmp_path / "cache" / "kvengine" / "torch_extensions"))
