"""Load this rank's shard of a model: built-in tiny (None), an HF folder, or a .gguf file."""

from pathlib import Path

import torch

from worker.model.config import ModelConfig
from worker.model.llama import LlamaModel
from worker.model.tiny import random_weights, tiny_config
from worker.model.weights import WeightSource, read_config
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


def load_model(model: str | None, tp: TPGroup, max_model_len: int | None, dtype: torch.dtype, device) -> LlamaModel:
    """max_model_len sizes the RoPE table; None means the model's max_position_embeddings."""
    raw, src = load_config_and_weights(model)
    cfg = ModelConfig.from_dict(raw)
    cfg.check_tp(tp.size)
    return LlamaModel(cfg, src, tp, max_model_len or cfg.max_position_embeddings, dtype, device)
