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
    WorkerError,
    WorkerKVReport,
    WorkerReady,
)
from protocol.sampling import SamplingParams
