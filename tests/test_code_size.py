"""The size rules ruff cannot keep (its C901, configured in pyproject.toml, keeps complexity at 12): in the
packages no function is over 60 lines, from its def line to its last line, docstring included, and no module
is over 400 lines."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "engine_core", "worker", "launch")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400
MODULES = sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def long_functions(source: str) -> list[str]:
    return [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]


@pytest.mark.parametrize("path", MODULES, ids=lambda path: str(path.relative_to(ROOT)))
def test_functions_and_modules_stay_small(path):
    source = path.read_text()
    assert long_functions(source) == []
    assert len(source.splitlines()) <= MAX_MODULE_LINES


def test_a_function_is_measured_from_its_def_line_to_its_last():
    def method(num_lines: int) -> str:
        return "class A:\n    def f(self):\n" + "".join(f"        x{i} = {i}\n" for i in range(num_lines - 1))

    assert long_functions(method(MAX_FUNCTION_LINES)) == []
    assert long_functions(method(MAX_FUNCTION_LINES + 1)) == [f"f (line 2): {MAX_FUNCTION_LINES + 1} lines"]
