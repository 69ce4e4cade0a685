"""The disk tier in a replay: the real engine-core side (DiskConnectorScheduler) over a private in-memory index,
and this model of the workers' side, which prices the transfers.

Saves go to the index at once (a worker writes them in the background, off the step's path) and evict past the
tier's size; a load is priced at read_cost_per_token for each token it brings in, added to the step that starts
it (as if the step waited for the disk: pessimistic, since the engine overlaps loads with other requests'
steps), and reported finished with that step.
"""

from dataclasses import dataclass

from engine_core.kv_connector.disk import DiskConnectorScheduler
from protocol.kv_store.index import BlockIndex
from protocol.kv_transfer import KVConnectorMetadata, KVConnectorOutput

DEFAULT_READ_COST_PER_TOKEN = 2e-6  # an 8B-class model's 128 KiB of KV a token at 64 GB/s (several NVMe drives)


@dataclass(frozen=True)
class TierModel:
    tokens: int  # the tier's size
    read_cost_per_token: float = DEFAULT_READ_COST_PER_TOKEN
    eviction: str = "lru"


class SimDiskTier:
    def __init__(self, model: TierModel, block_size: int, swap: bool = False) -> None:
        self.model = model
        self.block_size = block_size
        self.index = BlockIndex(":memory:", model.eviction)
        self.budget = model.tokens // block_size  # a block counts 1
        self.connector = DiskConnectorScheduler([self.index], block_size, swap)
        self.clock = 0.0
        self.loaded_tokens = 0

    def run(self, meta: KVConnectorMetadata) -> tuple[KVConnectorOutput, float]:
        """The step's transfers done, and the seconds its loads cost."""
        self.clock += 1.0  # lru orders by use: one tick a step
        now = self.clock
        self.index.add([(key, 1) for key in meta.save_keys], now)
        removed = self.index.evict(self.budget)
        out = KVConnectorOutput(saved_keys=list(meta.save_keys), removed_keys=removed)
        tokens = 0
        for load in meta.loads:
            present = self.index.leading(load.keys)  # evicted since the lookup: the rest is computed
            self.index.touch(load.keys[:present], now)
            out.finished_loads.append(load.req_id)
            out.num_loaded_blocks.append(present)
            tokens += present * self.block_size
        self.loaded_tokens += tokens
        return out, tokens * self.model.read_cost_per_token
