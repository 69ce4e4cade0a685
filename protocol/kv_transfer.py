"""What the engine core and the workers say about KV transfers to and from a second tier (the KV connector).

The engine core decides (which blocks to load into which freshly allocated blocks, which computed blocks to
save); the workers move the data and say which transfers finished. Blocks are named by their ledger key:
the chained block hash (cache salt included) followed by the KV cache group id.
"""

import msgspec

_struct = {"array_like": True, "omit_defaults": True}


class KVLoad(msgspec.Struct, **_struct):
    """Load a request's blocks, in order: keys[i] into block_ids[i]. Stops at the first block that fails."""

    req_id: str
    block_ids: list[int]
    keys: list[bytes]


class KVConnectorMetadata(msgspec.Struct, **_struct):
    """One step's transfers. Saves are copied out before the step's forward (their blocks were computed by
    earlier steps and may be reused by this one); loads run in the background, into blocks no step touches
    until the load is reported finished."""

    save_block_ids: list[int] = []
    save_keys: list[bytes] = []
    loads: list[KVLoad] = []


class KVConnectorOutput(msgspec.Struct, **_struct):
    """Transfers that finished since the worker's last answer."""

    finished_loads: list[str] = []  # request ids
    num_loaded_blocks: list[int] = []  # per finished load: its leading blocks that loaded (all, when none failed)
    saved_keys: list[bytes] = []  # blocks now findable in the tier
    failed_save_keys: list[bytes] = []  # blocks that could not be written (a full disk): not in the tier
    removed_keys: list[bytes] = []  # blocks the tier dropped (evicted for room, or found corrupt)
    load_bytes: int = 0
    save_bytes: int = 0
    num_failed_blocks: int = 0  # blocks that were missing or corrupt when loaded


class KVTierStats(msgspec.Struct, kw_only=True):
    """A second tier's totals since start-up (the engine core's metrics; the disk tier's medium is "DISK")."""

    medium: str
    hits: int = 0  # prompt tokens found in the tier beyond the memory hit, at admission
    loaded_blocks: int = 0
    load_bytes: int = 0
    saved_blocks: int = 0
    save_bytes: int = 0
    failed_blocks: int = 0  # missing or corrupt when loaded: recomputed
    removed_blocks: int = 0  # dropped by the tier (evicted for room, or corrupt)
