"""Wire structs (msgspec) and their codecs. Depends on msgspec only."""

from protocol.codec import Codec, ProtocolError
from protocol.digest import block_ids_digest
from protocol.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch
from protocol.messages import (
    CachedRequestData,
    EngineCoreAbort,
    EngineCoreGetStats,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreResetPrefixCache,
    InitKVCache,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    Shutdown,
    TokenLogprobs,
    WorkerError,
    WorkerKVReport,
    WorkerReady,
)
from protocol.sampling import SamplingParams

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "CachedRequestData",
    "Codec",
    "EngineCoreAbort",
    "EngineCoreGetStats",
    "EngineCoreOutput",
    "EngineCoreOutputs",
    "EngineCoreRequest",
    "EngineCoreResetPrefixCache",
    "FullAttentionSpec",
    "InitKVCache",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVEventBatch",
    "ModelRunnerOutput",
    "NewRequestData",
    "ProtocolError",
    "SamplingParams",
    "SchedulerOutput",
    "SchedulerStats",
    "Shutdown",
    "SlidingWindowSpec",
    "TokenLogprobs",
    "WorkerError",
    "WorkerKVReport",
    "WorkerReady",
    "block_ids_digest",
]
