"""The second KV tier the settings ask for, or None."""

from engine_core.kv_connector.base import KVConnectorScheduler
from engine_core.kv_connector.disk import DiskConnectorScheduler
from protocol import KVCacheConfig
from protocol.config import EngineConfig
from protocol.kv_store.index import BlockIndex
from protocol.kv_store.layout import DiskLayout


def make_kv_connector(config: EngineConfig, kv_cache_config: KVCacheConfig,
                      kv_fingerprint: str) -> KVConnectorScheduler | None:
    """kv_fingerprint: the workers' (WorkerKVReport.kv_fingerprint, equal on every rank); they made the tier's
    folders and indexes, one per tensor-parallel rank."""
    path = config.cache.kv_disk_path
    if path is None:
        return None
    if not kv_fingerprint:
        raise ValueError("kv_disk_path: the workers reported no KV fingerprint")
    tp = config.parallel.tensor_parallel_size
    indexes = [BlockIndex(DiskLayout(path, kv_fingerprint, rank, tp).index_path, config.cache.kv_disk_eviction)
               for rank in range(tp)]
    groups = kv_cache_config.kv_cache_groups
    return DiskConnectorScheduler(indexes, groups[0].kv_cache_spec.block_size,
                                  swap=config.scheduler.preemption_mode == "swap",
                                  windows=[getattr(g.kv_cache_spec, "sliding_window", None) for g in groups],
                                  enable_kv_cache_events=config.enable_kv_cache_events)
