"""KV cache events: what the ledger stored, removed or cleared, for routers that follow prefixes."""

import msgspec


class BlockStored(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    group_id: int = 0


class BlockRemoved(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    block_hashes: list[bytes]
    group_id: int = 0


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    seq: int  # increases by one per published batch
    timestamp: float
    events: list[KVCacheEvent]
