"""Every message that crosses a process boundary. Tagged unions let one decoder read one socket."""

import math
from typing import Annotated, Literal

import msgspec

from protocol.kv_cache_spec import KVCacheConfig, KVCacheSpec
from protocol.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from protocol.sampling import SamplingParams

_struct = {"array_like": True, "omit_defaults": True}

# ---- client -> engine core ------------------------------------------------------------------


MAX_REQUEST_ID_LENGTH = 256
# A protocol cap far above any max_model_len served here (the scheduler applies that one); a type bound,
# so that decode refuses a longer prompt from the list header instead of building it first.
MAX_PROMPT_TOKENS = 1 << 20
MIN_PRIORITY, MAX_PRIORITY = -(2**31), 2**31 - 1


class EngineCoreRequest(msgspec.Struct, tag=True, **_struct):
    """Bounds are checked on construction and on decode (msgspec runs __post_init__ for both)."""

    request_id: str
    prompt_token_ids: Annotated[list[int], msgspec.Meta(max_length=MAX_PROMPT_TOKENS)]
    sampling_params: SamplingParams
    arrival_time: float  # finite: it orders the queue
    cache_salt: str | None = None
    priority: int = 0  # lower runs first under --scheduling-policy priority

    def __post_init__(self) -> None:
        if len(self.request_id) > MAX_REQUEST_ID_LENGTH:
            raise ValueError(f"request_id has {len(self.request_id)} characters, more than {MAX_REQUEST_ID_LENGTH}")
        if len(self.prompt_token_ids) > MAX_PROMPT_TOKENS:
            raise ValueError(f"the prompt has {len(self.prompt_token_ids)} tokens, more than {MAX_PROMPT_TOKENS}")
        if not math.isfinite(self.arrival_time):
            raise ValueError(f"arrival_time must be finite, got {self.arrival_time!r}")
        if not MIN_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise ValueError(f"priority must be in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {self.priority!r}")


class EngineCoreAbort(msgspec.Struct, tag=True, **_struct):
    request_ids: list[str]


class EngineCoreGetStats(msgspec.Struct, tag=True, **_struct):
    """Ask for a SchedulerStats snapshot; answered by an EngineCoreOutputs with no outputs."""


class EngineCoreResetPrefixCache(msgspec.Struct, tag=True, **_struct):
    """Drop every cached prefix; refused while any block is in use. Answered with reset_prefix_cache set."""


class EngineCoreGetInfo(msgspec.Struct, tag=True, **_struct):
    """Ask what the engine serves (a router's or API server's ready handshake); answered with info set."""


ClientMessage = (
    EngineCoreRequest | EngineCoreAbort | EngineCoreGetStats | EngineCoreResetPrefixCache | EngineCoreGetInfo
)

# ---- engine core -> client ------------------------------------------------------------------

FinishReason = Literal["length", "stop", "abort", "error"]


class TokenLogprobs(msgspec.Struct, **_struct):
    """A sampled token's log-probability under the model (before temperature, top-k and top-p), and the
    most likely tokens' ids and log-probabilities, most likely first."""

    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int | None = None  # prompt log-probabilities: the token's rank in its distribution (1: most likely)


class EngineCoreOutput(msgspec.Struct, **_struct):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None  # set once the request is finished
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why the request was rejected or failed
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for them
    # with the first token, when the request asked: one per prompt token from the second on (the first has none)
    prompt_logprobs: list[TokenLogprobs] | None = None


class SchedulerStats(msgspec.Struct, **_struct):
    """A snapshot of the engine core after one step; counters are totals since start-up."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks_held: int = 0  # blocks referenced by running requests
    num_cached_free_blocks: int = 0  # free, but still hold a cached prefix (evictable)
    num_tokens_stored: int = 0  # tokens in the held blocks (shared ones once): occupancy = stored / (held * block size)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    step: int = 0
    # --data-parallel-size > 1: the router answers the sum over the engine cores, and each one's here, by index
    engines: "list[SchedulerStats] | None" = None
    # --speculative-config: steps that verified a request's drafts, draft tokens, accepted ones, and accepted ones
    # by draft position (vLLM's spec_decode counters)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


class EngineInfo(msgspec.Struct, **_struct):
    """What an engine serves, as its start-up resolved it (behind a DP router: the engines' common values)."""

    max_model_len: int
    block_size: int
    num_gpu_blocks: int  # usable blocks (the null block excluded); behind a DP router, the sum over the engines


class EngineCoreOutputs(msgspec.Struct, **_struct):
    outputs: list[EngineCoreOutput]
    timestamp: float = 0.0
    stats: SchedulerStats | None = None
    reset_prefix_cache: bool | None = None  # the answer to EngineCoreResetPrefixCache: False = refused
    info: EngineInfo | None = None  # the answer to EngineCoreGetInfo


# ---- engine core -> workers -----------------------------------------------------------------


class NewRequestData(msgspec.Struct, **_struct):
    """A request the workers have not seen, or one resuming after preemption: all its block ids."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated before a preemption; replayed as input
    sampling_params: SamplingParams
    block_ids: list[list[int]]  # one list per KV cache group
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, **_struct):
    """Running requests, column-wise: only newly appended block ids travel.

    Blocks that left a sliding window are not sent either: both sides put the null block 0 in the first
    `kv_cache_spec.num_skipped_blocks(num_computed_tokens, window, block_size)` places of the table."""

    req_ids: list[str] = []
    new_block_ids: list[list[list[int]] | None] = []  # per request: per group, or None
    num_computed_tokens: list[int] = []

    def __post_init__(self) -> None:
        if not len(self.req_ids) == len(self.new_block_ids) == len(self.num_computed_tokens):
            raise ValueError("CachedRequestData columns differ in length")


class SchedulerOutput(msgspec.Struct, tag=True, **_struct):
    step: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    # --check-block-tables: per scheduled request, block_ids_digest of its whole block list
    block_table_digests: dict[str, bytes] | None = None
    # --speculative-config: per request with drafts, its draft tokens; num_scheduled_tokens counts them too (vLLM's)
    scheduled_spec_decode_tokens: dict[str, list[int]] | None = None


class KVSchedulerOutput(SchedulerOutput, tag=True, **_struct):
    """A step with second-tier transfers (--kv-disk-path). A subclass, not a field appended to SchedulerOutput:
    msgspec writes every field of an array-like struct, so a new field would change every step's bytes."""

    kv_connector_metadata: KVConnectorMetadata = msgspec.field(default_factory=KVConnectorMetadata)


class GrammarOutput(msgspec.Struct, tag=True, **_struct):
    """The next-token bitmask of a step's constrained requests that sample (engine_core/structured_output/), sent to
    rank 0 after the step's SchedulerOutput once their grammars have taken every earlier token: with async
    scheduling, after the previous step's output is applied, while this step's forward runs. Row i belongs to
    structured_output_request_ids[i], in the step's batch order; token t is allowed where bit t % 32 of the row's
    little-endian int32 word t // 32 is set."""

    step: int
    structured_output_request_ids: list[str]
    grammar_bitmask: bytes


class InitKVCache(msgspec.Struct, tag=True, **_struct):
    """Start-up: the final KV cache config (minimum block count across ranks)."""

    kv_cache_config: KVCacheConfig


class Shutdown(msgspec.Struct, tag=True, **_struct):
    error: str = ""  # to a headless host: why the head stops after a failure (the host then exits non-zero)


HEARTBEAT_INTERVAL = 0.5  # seconds, each way between the head and a headless host
HEARTBEAT_TIMEOUT = 3.0  # silence after which the other side counts as dead or cut off


class EngineHeartbeat(msgspec.Struct, tag=True, **_struct):
    """Several hosts: the engine core is alive (sent to each headless host's process, answering its NodeHeartbeat)."""


EngineToWorker = SchedulerOutput | KVSchedulerOutput | GrammarOutput | InitKVCache | Shutdown | EngineHeartbeat

# ---- workers -> engine core -----------------------------------------------------------------


class WorkerKVReport(msgspec.Struct, tag=True, **_struct):
    """Start-up: what this rank can give the KV cache, and the spec of each attention layer."""

    rank: int
    available_kv_bytes: int
    kv_cache_specs: dict[str, KVCacheSpec]  # layer name -> spec (this rank's KV heads)
    eos_token_ids: list[int]
    max_position_embeddings: int
    vocab_size: int
    memory_detail: str = ""  # the terms of the budget, for the start-up log
    host: str = ""  # several hosts: the rank's host, for the start-up log
    kv_fingerprint: str = ""  # model, dtype, block size and KV layout: the disk tier keeps blocks under it


class WorkerReady(msgspec.Struct, tag=True, **_struct):
    rank: int
    num_blocks: int


class ModelRunnerOutput(msgspec.Struct, tag=True, **_struct):
    step: int
    req_ids: list[str]
    sampled_token_ids: list[list[int]]  # per request; empty for a prefill chunk that samples nothing
    logprobs: list[TokenLogprobs | None] | None = None  # per request, for those that asked (rank 0 only)
    # per request: the prompt's log-probabilities in the step that samples its first token, for those that asked
    prompt_logprobs: list[list[TokenLogprobs] | None] | None = None


class KVModelRunnerOutput(ModelRunnerOutput, tag=True, **_struct):
    """A step's output with second-tier transfers that finished (a subclass: see KVSchedulerOutput)."""

    kv_connector_output: KVConnectorOutput = msgspec.field(default_factory=KVConnectorOutput)


class WorkerError(msgspec.Struct, tag=True, **_struct):
    rank: int
    message: str


class NodeHeartbeat(msgspec.Struct, tag=True, **_struct):
    """Several hosts: a headless host's process is alive, and so are its workers (it watches them)."""

    node_rank: int
    host: str
    tensor_parallel_size: int  # as this host was started: the head refuses a host that counts otherwise
    nnodes: int


WorkerToEngine = WorkerKVReport | WorkerReady | ModelRunnerOutput | KVModelRunnerOutput | WorkerError | NodeHeartbeat

