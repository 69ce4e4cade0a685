"""Every module the packages import is Python's own, the project's, or installed by a dependency pyproject.toml
declares (itself or one it requires), so `pip install -e .` alone runs them (numpy was imported and not declared,
and the CPU torch does not require it: the README's first command failed).

Imports under `if TYPE_CHECKING:` are left out (they never run). An extra's package may only be imported where
that extra is used; the table below names each one with its extra. .ci/run's fresh-venv step checks the same
thing at run time.
"""

import ast
import re
import sys
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protocol", "engine_core", "worker", "launch")
EXTRA_OF = {"triton": "cuda", "gguf": "gguf", "matplotlib": "plot",  # imported only where that extra serves
            "transformers": "transformers"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """(the dependencies' names, extra -> its dependencies' names), from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {normalized(Requirement(r).name) for r in project["dependencies"]}
    extras = {extra: {normalized(Requirement(r).name) for r in reqs}
              for extra, reqs in project["optional-dependencies"].items()}
    return names, extras


def with_requirements(names: set[str]) -> set[str]:
    """names and every distribution they require, recursively (markers evaluated here, no extras)."""
    found, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found.add(name)
        try:
            wanted = [Requirement(r) for r in requires(name) or []]
        except PackageNotFoundError:
            continue
        todo += [normalized(r.name) for r in wanted if r.marker is None or r.marker.evaluate({"extra": ""})]
    return found


def type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imported_top_names(tree: ast.AST) -> set[str]:
    """The top-level module names of every absolute import in tree, outside `if TYPE_CHECKING:` blocks."""
    names, todo = set(), [tree]
    while todo:
        node = todo.pop()
        if type_checking_only(node):
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        todo += ast.iter_child_nodes(node)
    return names


def third_party_imports() -> dict[str, list[str]]:
    """Top-level module name -> the package files that import it, for modules neither stdlib nor the project's."""
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in imported_top_names(ast.parse(path.read_text())):
                if name not in sys.stdlib_module_names and name not in PACKAGES:
                    found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_imported_package_is_declared():
    dependencies, extras = declared()
    distributions = packages_distributions()
    missing = []
    for name, files in third_party_imports().items():
        dists = {normalized(d) for d in distributions.get(name, [])}
        assert dists, f"{name} (imported by {files}) is not installed here, so its distribution is unknown"
        wanted = with_requirements(extras[EXTRA_OF[name]] if name in EXTRA_OF else dependencies)
        if not dists & wanted:
            missing.append(f"{name} ({'/'.join(sorted(dists))}) imported by {', '.join(files)}")
    assert missing == [], "imported but not declared in pyproject.toml"


def test_imports_in_functions_count_and_type_checking_ones_do_not():
    tree = ast.parse("import numpy\nif TYPE_CHECKING:\n    import typing_extensions\ndef f():\n    import yaml\n")
    assert imported_top_names(tree) == {"numpy", "yaml"}


@pytest.mark.parametrize("name", sorted(EXTRA_OF))
def test_the_extras_table_names_real_extras(name):
    dependencies, extras = declared()
    assert normalized(name) in extras[EXTRA_OF[name]] and normalized(name) not in dependencies
