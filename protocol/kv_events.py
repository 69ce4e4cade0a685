"""KV cache events, laid out field for field like vLLM's (vllm/distributed/kv_events.py), so that a
router written for vLLM's events decodes kvengine's unchanged.

Encoding (msgpack), as vLLM's structs give it:
  KVEventBatch  an array [ts, events, data_parallel_rank] (array_like: every field, defaults too)
  each event    a map: "type" holds the class name (tag=True), then the fields in declaration order;
                a field equal to its default is left out (omit_defaults)

What kvengine puts in them:
  block hashes  ints, the low 64 bits of the ledger's digest read big-endian (external_block_hash):
                what vLLM sends by default; its schema also allows the raw digest bytes
  group_idx     the ledger's KV cache group id, in vLLM's field for it
  kv_cache_spec_kind, kv_cache_spec_sliding_window  the group's "full_attention", or "sliding_window" and its window
  medium        MEDIUM_GPU for the engine's own KV cache (vLLM's name for it, also when kvengine runs on CPU);
                MEDIUM_DISK for the disk tier (--kv-disk-path): stored once a block is written there, removed
                when the tier drops it
  lora_id, lora_name  None: kvengine has no LoRA
  extra_keys    per stored block, the extra keys hashed into it: (cache_salt,) on a request's first block

The sequence number of a batch is not in the struct: like vLLM, it travels in the frame.
  live (PUB):      [TOPIC, seq, KVEventBatch]; seq is 8 bytes, unsigned big-endian, counting from 0
  replay (ROUTER): the client (REQ, or DEALER sending the empty delimiter itself) sends [b"", start seq];
                   it gets [b"", TOPIC, seq, KVEventBatch] for each buffered batch from start seq on,
                   then [b"", b"", END_SEQ, b""]
"""

from typing import Any

import msgspec

TOPIC = b"kv-events"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # marks the end of a replay
MEDIUM_GPU = "GPU"
MEDIUM_DISK = "DISK"

# vLLM's ExternalBlockHash: kvengine always sends the int form.
ExternalBlockHash = bytes | int


def external_block_hash(block_hash: bytes) -> int:
    """A ledger digest as vLLM sends block hashes by default: its low 64 bits, read big-endian."""
    return int.from_bytes(block_hash, "big") & (2**64 - 1)


class KVCacheEventBase(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's KVCacheEvent base class: the struct options the three events share."""


class BlockStored(KVCacheEventBase):
    """Full blocks registered in the prefix cache, in chain order; parent_block_hash precedes the first."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEventBase):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEventBase):
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step. vLLM declares ts, events and the rank on a base class; same wire."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None
