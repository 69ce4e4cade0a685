"""Load this rank's shard of a model: built-in tiny (None), an HF folder, or a .gguf file; served natively or, for
an HF folder, by the transformers fallback (--model-impl)."""

import logging
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from protocol.model.config import ModelConfig, UnsupportedArchitecture
from protocol.model.source import read_config, tiny_config
from worker.model.llama import LlamaModel
from worker.model.registry import NATIVE
from worker.model.tiny import random_weights
from worker.model.transformers_backend import TransformersModel, fallback_config, import_transformers
from worker.model.weights import WeightSource
from worker.parallel import TPGroup

log = logging.getLogger(__name__)


def load_config_and_weights(model: str | None, quantization: str | None = None) -> tuple[dict, WeightSource]:
    """quantization: --quantization (None: as the checkpoint is), checked against the kind of model."""
    gguf = model is not None and Path(model).suffix == ".gguf"
    if quantization == "gguf" and not gguf:
        raise ValueError("--quantization gguf is for a .gguf model; a Hugging Face folder takes rtn or none")
    if quantization == "rtn" and gguf:
        raise ValueError("--quantization rtn quantizes a Hugging Face folder's weights; a .gguf model takes gguf "
                         "(its quantized weights kept) or none (dequantized)")
    dense = "rtn" if quantization == "rtn" else None
    if model is None:
        raw = tiny_config()
        return raw, WeightSource(tensors=random_weights(raw), quantization=dense)
    path = Path(model)
    if gguf:
        from worker.model.gguf_loader import load_gguf

        raw, tensors = load_gguf(path, keep_quantized=quantization != "none")
        return raw, WeightSource(tensors=tensors)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{model}: expected a folder with config.json and *.safetensors, or a .gguf file")
    return read_config(path), WeightSource(folder=path, quantization=dense)


@dataclass
class LoadedModel:
    """A model's config and weights, and which implementation will serve it."""

    cfg: ModelConfig
    weights: WeightSource
    impl: str  # "native" or "transformers"
    path: str | None

    def build(self, tp: TPGroup, max_positions: int, dtype, device,
              ops: ModuleType | None) -> LlamaModel | TransformersModel:
        arch = self.cfg.architecture
        if self.impl == "transformers":
            import transformers

            log.info("%s is served by the transformers fallback (transformers %s; attention by kvengine's paged "
                     "attention)", arch, transformers.__version__)
            assert self.path is not None
            return TransformersModel(self.path, self.cfg, tp, dtype, device)
        log.info("%s is served by kvengine's native implementation", arch)
        native = NATIVE[arch]
        return LlamaModel(self.cfg, self.weights, tp, max_positions, dtype, device, ops, native.layer_type,
                          native.layout)


def load_model(model: str | None, tp_size: int, model_impl: str = "auto",
               quantization: str | None = None) -> LoadedModel:
    """Config and weight source, the implementation chosen (auto: native where there is one), refusing a TP size
    that does not divide the head counts."""
    raw, src = load_config_and_weights(model, quantization)
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if model_impl == "transformers" or (model_impl == "auto" and arch not in NATIVE):
        if quantization == "rtn":
            raise ValueError(f"--quantization rtn needs the native implementation; {arch} is served by "
                             "--model-impl transformers here")
        if model is None or Path(model).suffix == ".gguf":
            what = "the built-in model" if model is None else "a GGUF file"
            raise ValueError(f"--model-impl transformers serves a Hugging Face folder, not {what}")
        if tp_size > 1:
            raise ValueError(f"--model-impl transformers serves {arch} at tensor parallel size 1, not {tp_size}")
        transformers = import_transformers()
        cfg = fallback_config(transformers.AutoConfig.from_pretrained(model), arch)
        return LoadedModel(cfg, src, "transformers", model)
    try:
        cfg = ModelConfig.from_dict(raw)
    except UnsupportedArchitecture as e:
        raise UnsupportedArchitecture(f"{e}; --model-impl transformers (or auto) serves it through transformers") \
            from e
    cfg.check_tp(tp_size)
    return LoadedModel(cfg, src, "native", model)
