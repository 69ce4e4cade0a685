"""protocol/ depends on msgspec and the standard library only (DESIGN.md); no pickle anywhere."""

import ast
import pathlib
import subprocess
import sys

import protocol

PROTOCOL_DIR = pathlib.Path(protocol.__file__).parent
ALLOWED = {"msgspec", "protocol", "typing", "hashlib", "array", "__future__", "dataclasses", "enum", "math"}


def _imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0]


def test_only_msgspec_and_stdlib_imports():
    for path in PROTOCOL_DIR.glob("*.py"):
        bad = set(_imports(path)) - ALLOWED
        assert not bad, f"{path.name} imports {bad}"


def test_no_pickle():
    for path in PROTOCOL_DIR.glob("*.py"):
        assert "pickle" not in path.read_text(), path.name


def test_import_does_not_pull_heavy_packages():
    code = "import sys, protocol; print(sorted(m for m in ('torch', 'zmq', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PROTOCOL_DIR.parent)
    assert out.stdout.strip() == "[]"
