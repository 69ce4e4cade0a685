"""protocol/ depends on msgspec and the standard library only (docs/architecture.md); no pickle anywhere.

Its two sub-packages are the ground floor every process shares beyond the wire: protocol/process/ (what
every process does alike at spawn: worker configs, CPU binding, signals, open files, host labels) and
protocol/model/ (what a model is: config.json and GGUF metadata readers, tokenizer loading); protocol/kv_store/
is the disk tier's layout and index, which the engine core reads and the workers write. None imports torch, so
the engine core, the API server and the DP router can read them.
"""

import ast
import pathlib
import subprocess
import sys

import protocol

PROTOCOL_DIR = pathlib.Path(protocol.__file__).parent
# os: the config reads the API keys from the environment, so that they never travel on a command line.
ALLOWED = {"msgspec", "protocol", "typing", "hashlib", "array", "__future__", "dataclasses", "enum", "math", "os"}


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0]


SUBPACKAGE_ALLOWED = {
    "process": ALLOWED | {"contextlib", "fcntl", "logging", "os", "re", "resource", "signal", "socket", "struct"},
    "model": ALLOWED | {"json", "pathlib", "tokenizers", "gguf"},
    "kv_store": ALLOWED | {"collections", "contextlib", "os", "sqlite3", "struct", "zlib"},
}


def test_only_msgspec_and_stdlib_imports():
    for path in PROTOCOL_DIR.glob("*.py"):
        bad = set(_imports(path)) - ALLOWED
        assert not bad, f"{path.name} imports {bad}"


def test_subpackages_import_no_torch_and_only_their_allowed_modules():
    for sub, allowed in SUBPACKAGE_ALLOWED.items():
        for path in (PROTOCOL_DIR / sub).glob("*.py"):
            bad = set(_imports(path)) - allowed
            assert not bad, f"{sub}/{path.name} imports {bad}"


def test_no_pickle():
    for path in PROTOCOL_DIR.rglob("*.py"):
        assert "pickle" not in path.read_text(), path.name


def test_import_does_not_pull_heavy_packages():
    code = "import sys, protocol; print(sorted(m for m in ('torch', 'zmq', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PROTOCOL_DIR.parent)
    assert out.stdout.strip() == "[]"
