"""The workers' side of the second KV tier the settings ask for, or None."""

from protocol.config import EngineConfig
from protocol.kv_store.layout import DiskLayout
from worker.kv_connector.disk import DiskConnectorWorker
from worker.kv_connector.ranks import RankMerge


def make_kv_connector_worker(config: EngineConfig, kv_fingerprint: str, rank: int,
                             kv_caches: list) -> DiskConnectorWorker | None:
    cache = config.cache
    if cache.kv_disk_path is None:
        return None
    tp = config.parallel.tensor_parallel_size
    return DiskConnectorWorker(DiskLayout(cache.kv_disk_path, kv_fingerprint, rank, tp), cache.kv_disk_bytes,
                               cache.kv_disk_eviction, kv_caches, RankMerge(tp) if tp > 1 else None)
