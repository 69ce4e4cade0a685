"""Build the CPU kernels' C++ extension once per source, compiler and torch installation; load it.

The build folder under ~/.cache/kvengine/torch_extensions/ (or $XDG_CACHE_HOME) is named by a hash of
everything the build reads: the sources and headers, the compiler flags (the CPU's vector ISA among them),
the compiler (path and version), Python's headers and the torch installation (path and version). The
sources are copied into the folder and compiled from there, so checkouts with the same sources share one
build and never relink each other's, and another torch (another venv) or another source gets a folder of
its own. One process builds or loads a folder at a time (a flock): a second one waits, then loads the build.
"""

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

OPS_DIR = Path(__file__).parent
SOURCES = ("paged_attention.cpp", "kv_quant.cpp", "layer_ops.cpp", "quant_matmul.cpp", "half_matmul.cpp",
           "module.cpp")
HEADERS = tuple(sorted(path.name for path in OPS_DIR.glob("*.h")))  # what the sources include
EXTENSION_NAME = "kvengine_paged_attention"
BUILD_SECONDS = 60  # the build on two idle cores (43 s measured); several times that on a busy machine
# -fopenmp: at::parallel_for is inline and runs serially in code built without OpenMP
BASE_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=fast")
LDFLAGS = ("-fopenmp",)
ISA_FLAGS = {
    "AVX512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512dq",
        "-mavx512vl",
        "-mavx2",
        "-mfma",
        "-mf16c",
        "-mprefer-vector-width=512",
    ],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


class CpuAttentionUnavailable(RuntimeError):
    """The CPU attention extension cannot be built or loaded here; use the torch path."""


def build_extension() -> ModuleType:
    """The compiled extension: built into its folder unless a build is there, then loaded."""
    from torch.utils import cpp_extension

    files, cflags, toolchain = build_inputs()
    if not cpp_extension.is_ninja_available():
        raise CpuAttentionUnavailable("the ninja build tool is missing (pip install ninja)")
    folder = build_directory(files, cflags, toolchain)
    library = folder / f"{EXTENSION_NAME}.so"
    start = time.perf_counter()
    try:
        with build_lock(folder):
            before = library.stat().st_mtime_ns if library.exists() else None
            if before is None:
                log.info("building the CPU attention kernel, about %d s, once per kernel source, compiler and torch "
                         "installation: into %s", BUILD_SECONDS, folder)
            sources = copy_sources(folder, files)
            module = cpp_extension.load(name=EXTENSION_NAME, sources=[str(sources / name) for name in SOURCES],
                                        extra_cflags=cflags, extra_ldflags=list(LDFLAGS), build_directory=str(folder))
    except (RuntimeError, OSError, ImportError) as e:
        raise CpuAttentionUnavailable(f"building the CPU paged attention extension in {folder} failed: {e}") from e
    how = "compiled" if library.stat().st_mtime_ns != before else "loaded the cached build"
    log.info("CPU paged attention: %s in %.1f s (%s)", how, time.perf_counter() - start, folder)
    return module


def build_inputs() -> tuple[dict[str, bytes], list[str], list[str]]:
    """What this machine's build reads: the files by name, the compiler flags, the toolchain."""
    toolchain = compiler_identity(os.environ.get("CXX", "c++")) + torch_identity()
    files = {name: (OPS_DIR / name).read_bytes() for name in (*SOURCES, *HEADERS)}
    return files, [*BASE_CFLAGS, *isa_flags()], toolchain


def build_directory(files: dict[str, bytes], cflags: list[str], toolchain: list[str]) -> Path:
    """The folder of this build: named by a hash of the files' names and contents, the flags and the toolchain."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(hashlib.sha256(name.encode()).digest() + hashlib.sha256(files[name]).digest())
    digest.update(json.dumps([cflags, LDFLAGS, toolchain]).encode())
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvengine" / "torch_extensions"
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return base / f"{EXTENSION_NAME}-torch{torch.__version__}-{python}-{digest.hexdigest()[:16]}"


def compiler_identity(compiler: str) -> list[str]:
    """The compiler's path and the first line of its --version."""
    path = shutil.which(compiler)
    if path is None:
        raise CpuAttentionUnavailable(f"no C++ compiler: {compiler!r} is not on PATH (set CXX or install g++)")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CpuAttentionUnavailable(f"the C++ compiler {path} does not run: {e}") from e
    return [path, version.split("\n", 1)[0]]


def torch_identity() -> list[str]:
    """The torch installation (path and version) and Python's headers the extension compiles against."""
    return [str(Path(torch.__file__).parent), torch.__version__, sysconfig.get_paths()["include"]]


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """Hold the folder's flock. The kernel drops a flock with its holder, so under it a torch build lock
    ("lock") can only be one a killed build left, on which torch would wait forever: it is removed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.flock", "w") as flock:
        try:
            fcntl.flock(flock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process building or loading the CPU attention kernel in %s", folder)
            fcntl.flock(flock, fcntl.LOCK_EX)
        if (folder / "lock").exists():
            log.warning("removing the build lock a killed build left in %s", folder)
            (folder / "lock").unlink()
        yield


def copy_sources(folder: Path, files: dict[str, bytes]) -> Path:
    """The files in the build folder (written once, whole, so a file's time changes only with a new folder)."""
    sources = folder / "src"
    sources.mkdir(exist_ok=True)
    for name, content in files.items():
        if not (sources / name).exists():
            partial = sources / f"{name}.partial"
            partial.write_bytes(content)
            os.replace(partial, sources / name)
    return sources


def isa_flags() -> list[str]:
    flags = ISA_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    if "-mavx512f" in flags and "avx512_bf16" in cpu_flags():
        flags = [*flags, "-mavx512bf16"]  # bf16 attention scores by vdpbf16ps
    return flags


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags line of /proc/cpuinfo (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return frozenset(next(line for line in cpuinfo if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return frozenset()
