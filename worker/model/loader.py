"""Load this rank's shard of a model: built-in tiny (None), an HF folder, or a .gguf file."""

from pathlib import Path
from types import ModuleType

from protocol.model.config import ModelConfig
from protocol.model.source import read_config, tiny_config
from worker.model.llama import LlamaModel
from worker.model.registry import NATIVE
from worker.model.tiny import random_weights
from worker.model.weights import WeightSource
from worker.parallel import TPGroup


def load_config_and_weights(model: str | None) -> tuple[dict, WeightSource]:
    if model is None:
        raw = tiny_config()
        return raw, WeightSource(tensors=random_weights(raw))
    path = Path(model)
    if path.suffix == ".gguf":
        from worker.model.gguf_loader import load_gguf

        raw, tensors = load_gguf(path)
        return raw, WeightSource(tensors=tensors)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model}: expected a folder with config.json and *.safetensors, or a .gguf file")
    return read_config(path), WeightSource(folder=path)


def load_model(model: str | None, tp_size: int) -> tuple[ModelConfig, WeightSource]:
    """Config and weight source, refusing a TP size that does not divide the head counts."""
    raw, src = load_config_and_weights(model)
    cfg = ModelConfig.from_dict(raw)
    cfg.check_tp(tp_size)
    return cfg, src


def build_native(cfg: ModelConfig, src: WeightSource, tp: TPGroup, max_positions: int, dtype, device,
                 ops: ModuleType | None) -> LlamaModel:
    """The native implementation of cfg's architecture."""
    native = NATIVE[cfg.architecture]
    return LlamaModel(cfg, src, tp, max_positions, dtype, device, ops, native.layer_type, native.layout)
