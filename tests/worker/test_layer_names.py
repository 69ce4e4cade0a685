"""Layers travel by the names the worker reported; it maps them back with its own dict, nothing parsed."""

import pytest

from protocol import KVCacheConfig, KVCacheGroupSpec
from protocol.config import engine_config
from worker.worker import Worker


@pytest.fixture(scope="module")
def worker():
    return Worker(engine_config(max_model_len=64, kv_cache_memory_bytes=[1 << 24]))


def test_groups_reach_the_layers_they_name(worker):
    specs = worker.kv_cache_specs()
    names, spec = list(specs), next(iter(specs.values()))
    assert names == [f"model.layers.{i}.self_attn" for i in range(4)]
    # Interleaved groups: layer j of each group shares KV tensor j.
    groups = [KVCacheGroupSpec([names[3], names[0]], spec), KVCacheGroupSpec([names[1], names[2]], spec)]
    worker.init_kv_cache(KVCacheConfig(16, groups))
    assert worker.runner.kv.layer_slots == [(0, 1), (1, 0), (1, 1), (0, 0)]  # per layer: (group, tensor)


def test_a_layer_name_the_worker_did_not_report_is_refused(worker):
    specs = worker.kv_cache_specs()
    names, spec = list(specs), next(iter(specs.values()))
    cfg = KVCacheConfig(16, [KVCacheGroupSpec(["layers.0", *names[1:]], spec)])
    with pytest.raises(ValueError, match="names a layer this model does not have: 'layers.0'"):
        worker.init_kv_cache(cfg)
