"""The fingerprint a disk tier keeps blocks under: blocks of another model, dtype, block size or KV layout are never
read, because they live under another fingerprint."""

import hashlib
import os

import msgspec
import torch

from protocol import KVCacheSpec
from protocol.config import EngineConfig

LAYOUT = "per layer [2, kv_heads, num_blocks, block_size, head_size], a block's layers in order; v1"


def model_identity(model: str | None) -> list:
    """The model as files: a path, and each weight file's name, size and modification time."""
    if model is None:
        return ["built-in"]
    path = os.path.abspath(model)
    if os.path.isfile(path):
        st = os.stat(path)
        return [path, st.st_size, st.st_mtime_ns]
    entries = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_file())
    return [path, entries]


def kv_fingerprint(config: EngineConfig, model_config: object, dtype: torch.dtype,
                   specs: dict[str, KVCacheSpec]) -> str:
    """Equal on every rank: the specs are a rank's (its KV heads) and the tensor parallel size is in it; a rank's
    shards live in a folder of their own under it (protocol/kv_store/layout.py)."""
    identity = {
        "layout": LAYOUT,
        "model": model_identity(config.model.model),
        "model_config": repr(model_config),
        "dtype": str(dtype),
        "block_hash": config.cache.prefix_caching_hash_algo,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "specs": sorted((name, msgspec.json.encode(spec).decode()) for name, spec in specs.items()),
    }
    return hashlib.sha256(msgspec.json.encode(identity)).hexdigest()[:32]
