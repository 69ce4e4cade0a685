"""The second KV tier the settings ask for, or None."""

from engine_core.kv_connector.base import KVConnectorScheduler
from engine_core.kv_connector.disk import DiskConnectorScheduler
from protocol import FullAttentionSpec, KVCacheConfig
from protocol.config import EngineConfig
from protocol.kv_store.index import BlockIndex
from protocol.kv_store.layout import DiskLayout


def make_kv_connector(config: EngineConfig, kv_cache_config: KVCacheConfig,
                      kv_fingerprint: str) -> KVConnectorScheduler | None:
    """kv_fingerprint: the workers' (WorkerKVReport.kv_fingerprint); they made the tier's folder and index."""
    path = config.cache.kv_disk_path
    if path is None:
        return None
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        raise ValueError("kv_disk_path: the disk tier serves models whose layers all use full attention "
                         "(this one has sliding-window layers)")
    if not kv_fingerprint:
        raise ValueError("kv_disk_path: the workers reported no KV fingerprint")
    index = BlockIndex(DiskLayout(path, kv_fingerprint).index_path, config.cache.kv_disk_eviction)
    return DiskConnectorScheduler(index, groups[0].kv_cache_spec.block_size,
                                  swap=config.scheduler.preemption_mode == "swap",
                                  enable_kv_cache_events=config.enable_kv_cache_events)
