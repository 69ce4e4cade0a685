"""The engine's settings, declared once.

`EngineConfig` groups them by area. The `kvengine` flags are generated from these fields (name,
default, help, choices and range), the engine core reads them, and every worker receives the same
struct as JSON. Ranges are checked when an `EngineConfig` is built or decoded, so a bad value fails
at start-up with the field's path, wherever it came from.
"""

import os
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from protocol.speculative import parse_speculative_config

DEFAULT_BLOCK_SIZE = 16
API_KEY_ENV, ADMIN_API_KEY_ENV = "KVENGINE_API_KEY", "KVENGINE_ADMIN_API_KEY"  # as vLLM's VLLM_API_KEY

PositiveInt = Annotated[int, Meta(ge=1)]
Port = Annotated[int, Meta(ge=0, le=65535)]
ByteCount = Annotated[int, Meta(ge=0)]


def setting(help: str, **extra: object) -> Meta:
    """A field's CLI help; extra: aliases=[...] (more flag names), parse="bytes" (accept 4GiB, 512M)."""
    return Meta(description=help, extra=extra or None)


class _Area(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class ModelConfig(_Area, frozen=True):
    """model"""

    model: Annotated[str | None, setting(
        "local Hugging Face folder (config.json + safetensors) or a GGUF file; "
        "default: the built-in tiny model (random weights, no download)")] = None
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], setting(
        "weights and KV cache; auto: bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, float32 on other CPUs")] = "auto"
    max_model_len: Annotated[PositiveInt | None, setting(
        "longest prompt + output in tokens; default: the model's max_position_embeddings")] = None
    attention_backend: Annotated[Literal["auto", "cpu", "torch", "triton"], setting(
        "attention over the paged cache. cpu: a C++ kernel that reads K/V in place through the block tables "
        "(compiled on first use, cached under ~/.cache/kvengine); triton: a Triton kernel that does the same on "
        "CUDA (needs kvengine[cuda]; on CPU only with TRITON_INTERPRET=1); torch: gather + SDPA, any device, "
        "the reference; auto: cpu on CPU (torch if the kernel cannot be built), triton on CUDA (torch if triton "
        "is not installed)")] = "auto"
    enforce_eager: Annotated[bool, setting(
        "CUDA: run every step eagerly instead of replaying CUDA graphs captured for decode batch sizes")] = False
    model_impl: Annotated[Literal["auto", "native", "transformers"], setting(
        "which implementation serves the model. native: kvengine's own (Llama, Qwen2, Qwen3, Mistral, Phi-3, "
        "SmolLM3, Gemma 2 and 3, Qwen3-MoE, Mixtral, OLMoE): fused CPU ops, tensor parallel; transformers: any causal "
        "LM transformers can build from a Hugging Face folder, its attention through kvengine's paged attention "
        "(needs kvengine[transformers]; tensor parallel size 1); auto: native where there is one")] = "auto"
    quantization: Annotated[Literal["gguf", "rtn", "none"] | None, setting(
        "weight quantization, named as vLLM's --quantization. default: as the checkpoint is (a GGUF file as gguf, "
        "a Hugging Face folder dense); gguf (a .gguf model only): its Q8_0, Q4_0, Q4_1 and Q4_K linear weights, "
        "LM head included, stay quantized and are multiplied by weight-only int8/int4 kernels on the CPU (other "
        "types dequantized at load, as is everything on CUDA; the embedding is looked up dequantized); rtn (a Hugging Face "
        "folder or the built-in model, native implementation, CPU): linear weights rounded to int8 at load, one "
        "scale per 128 inputs (32 where the width is not a multiple of 128), half the bytes of bf16 per decode "
        "step; none: every weight dense, a GGUF file dequantized at load")] = None


class CacheConfig(_Area, frozen=True):
    """KV cache"""

    block_size: Annotated[PositiveInt, setting("tokens per KV block")] = DEFAULT_BLOCK_SIZE
    gpu_memory_utilization: Annotated[float, Meta(gt=0, le=1), setting(
        "CUDA: share of GPU memory for weights, activations and KV cache")] = 0.92
    kv_cache_memory_bytes: Annotated[list[ByteCount] | None, setting(
        "KV cache bytes per worker, skipping the memory profile: 4G or 4GiB = 4 GiB, 4g or 4GB = 4e9 bytes "
        "(as in vLLM); a comma list gives one value per rank. CPU default: room for max_num_seqs requests of "
        "max_model_len, at most a share of available RAM", parse="bytes")] = None
    num_gpu_blocks_override: Annotated[Annotated[int, Meta(ge=2)] | None, setting(
        "use exactly this many KV blocks (block 0 is the null block)")] = None
    kv_cache_dtype: Annotated[Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"], setting(
        "what the KV cache stores. auto: the model's --dtype; bfloat16: needs --dtype bfloat16 (= auto); "
        "fp8_e4m3 (fp8), fp8_e5m2, int8: one byte a value plus an fp32 scale per block, KV head and K/V, chosen "
        "from the block's values as they are written (about twice the blocks of bfloat16 in the same memory)")
    ] = "auto"
    enable_prefix_caching: Annotated[bool, setting("reuse KV blocks of identical prefixes")] = True
    prefix_caching_hash_algo: Annotated[Literal["sha256", "xxhash"], setting(
        "block hash: sha256 (cryptographic: cached prefixes are tenant data) or xxhash (faster)")] = "sha256"
    kv_disk_path: Annotated[str | None, setting(
        "a second KV tier on local disk in this folder: every computed full block is written there in the background "
        "(under a fingerprint of the model, dtype, block size and KV layout), and a prefix that misses memory but "
        "is on disk is loaded instead of computed; found again after a restart, shared by the engine cores of one "
        "host (-dp); under tensor parallelism each rank keeps its shard. Needs prefix caching and every rank on "
        "this host (default: off)")] = None
    kv_disk_bytes: Annotated[ByteCount | None, setting(
        "the disk tier's size bound (4GiB, 4GB or a byte count), all ranks' shards together; past it, or when its "
        "file system is full, blocks are deleted in --kv-disk-eviction order. Default: nine tenths of the free "
        "space of its file system at start-up", parse="bytes")] = None
    kv_disk_eviction: Annotated[Literal["lru", "fifo"], setting(
        "which disk blocks go first when the tier is full: lru (least recently loaded or saved) or fifo (oldest "
        "save). lru, measured on the Mooncake conversation trace with 4M tokens in memory and a 24M-token tier: "
        "36.0 per cent of prompt tokens hit, against 33.6 with fifo (docs/benchmarks.md)")] = "lru"


class SchedulerConfig(_Area, frozen=True):
    """scheduler"""

    max_num_seqs: Annotated[PositiveInt, setting("most running requests")] = 256
    max_num_batched_tokens: Annotated[PositiveInt, setting(
        "token budget of one step; longer prompts are prefilled in chunks")] = 2048
    enable_chunked_prefill: Annotated[bool, setting(
        "split a prompt that does not fit the step's remaining budget; off: it waits for a step where it fits")] = True
    long_prefill_token_threshold: Annotated[Annotated[int, Meta(ge=0)], setting(
        "a prompt with more uncomputed tokens than this gets at most this many per step, unless it is the only "
        "request running or waiting (0: no limit)")] = 0
    scheduling_policy: Annotated[Literal["fcfs", "priority"], setting(
        "fcfs, or priority: lower value first; preemption takes the largest value, then the latest arrival")] = "fcfs"
    watermark: Annotated[float, Meta(ge=0, lt=1), setting(
        "share of blocks kept free when admitting a request while others run")] = 0.0
    check_block_tables: Annotated[bool, setting(
        "every step carries a digest of each scheduled request's blocks; workers verify their tables")] = False
    preemption_mode: Annotated[Literal["recompute", "swap"], setting(
        "what a preempted request keeps: recompute (as vLLM v1: on resumption it computes again what memory no longer "
        "holds) or swap (its full blocks go to the disk tier and are loaded back on resumption; needs --kv-disk-path)")
    ] = "recompute"
    async_scheduling: Annotated[bool, setting(
        "schedule step N+1 while the workers run step N (vLLM's async scheduling): the engine core's work hides "
        "behind the forward; a request that stops is computed one step more, and that token is dropped")] = False
    speculative_config: Annotated[str | None, setting(
        "speculative decoding as vLLM's JSON object; kvengine runs n-gram drafting: "
        '\'{"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}\' '
        "(a decode step drafts up to K tokens: those that followed the earliest earlier occurrence of the request's "
        "longest suffix of M..N tokens; verified in one forward; greedy output unchanged, sampled output with the "
        "same distribution; prompt_lookup_min/max default to each other, or 5)")] = None

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            parse_speculative_config(self.speculative_config)  # a bad key or value fails at start-up, by name


class ParallelConfig(_Area, frozen=True):
    """parallelism and devices"""

    tensor_parallel_size: Annotated[PositiveInt, setting(
        "worker processes, one per GPU (gloo on CPU, NCCL on CUDA)", aliases=["-tp"])] = 1
    device: Annotated[Literal["cpu", "cuda"], setting("where the workers run")] = "cpu"
    cpu_threads_bind: Annotated[str, setting(
        "CPU workers: the cores of each rank's torch threads. auto: this process's CPU affinity mask split evenly "
        "among the ranks (none left to the engine core, idle while the workers compute), one torch thread per core "
        "while the cores are free, one fewer per core another process keeps busy (a thread sharing a core "
        "stalls the others at every barrier) and those pinned to the freest cores; nobind: no pinning, mask size / tp threads; or one core list per "
        "rank, e.g. 0-1|2-3 (as VLLM_CPU_OMP_THREADS_BIND), a fixed thread per core")
    ] = "auto"
    step_timeout: Annotated[float, Meta(ge=0), setting(
        "seconds to wait for the workers to answer one step before the engine names the rank that hangs, "
        "fails every request and exits (0: wait forever). The default, vLLM's execute-model timeout, is far "
        "above a healthy step on GPU or of the built-in model; a large model prefilled on CPU may need more")] = 300.0
    nnodes: Annotated[PositiveInt, setting(
        "hosts the tensor-parallel group spans; each runs tensor_parallel_size / nnodes workers")] = 1
    node_rank: Annotated[Annotated[int, Meta(ge=0)], setting(
        "this host's place among the nnodes hosts (0: the head, which runs the engine core)")] = 0
    master_addr: Annotated[str, setting(
        "the head host's address: other hosts' workers reach its engine core and torch.distributed's store there")
    ] = "127.0.0.1"
    master_port: Annotated[Annotated[int, Meta(ge=1, le=65535)], setting(
        "the head's torch.distributed store port; the engine core's worker socket is the port after it")] = 29501
    headless: Annotated[bool, setting(
        "run only this host's workers, connected to the head's engine core (a host with node_rank >= 1)")] = False
    data_parallel_size: Annotated[PositiveInt, setting(
        "engine cores, each with its own tensor-parallel group, behind one router on --address", aliases=["-dp"])
    ] = 1
    router_policy: Annotated[Literal["prefix", "round-robin", "least-load"], setting(
        "with data_parallel_size > 1: prefix sends a request to the engine holding the longest cached prefix of its "
        "blocks (least load where they tie); round-robin; least-load (running + waiting)")] = "prefix"


class ServerConfig(_Area, frozen=True):
    """server and observability"""

    address: Annotated[str | None, setting(
        "ZeroMQ address to serve on, e.g. ipc:///tmp/kv.sock or tcp://127.0.0.1:5555; "
        "default: a fresh ipc:// path, printed at start-up")] = None
    host: Annotated[str, setting("the address the HTTP API binds (and the metrics endpoint)")] = "127.0.0.1"
    port: Annotated[Port, setting("the OpenAI-compatible HTTP API's port (the ZeroMQ socket is --address)")] = 8000
    api_server_count: Annotated[Annotated[int, Meta(ge=0)], setting(
        "HTTP API processes sharing --port, each one more ZeroMQ client of the engine core "
        "(0: no HTTP API, only the ZeroMQ socket)")] = 1
    served_model_name: Annotated[str | None, setting(
        "the model name HTTP clients send; default: --model as given, or 'tiny' for the built-in model")] = None
    chat_template: Annotated[str | None, setting(
        "the chat template of /v1/chat/completions: its Jinja text, or a file holding it; default: the model's")] = None
    enable_auto_tool_choice: Annotated[bool, setting(
        "HTTP API: tool_choice auto (the default with tools): the model may call the request's tools, and its calls "
        "are found in its text by --tool-call-parser")] = False
    tool_call_parser: Annotated[Literal["hermes", "llama3_json", "mistral"] | None, setting(
        "HTTP API: the format of the model's tool calls: hermes (<tool_call> JSON: Qwen2.5, Qwen3, Hermes), "
        "llama3_json (Llama 3.1 and 3.2 JSON), mistral ([TOOL_CALLS])")] = None
    stats_interval: Annotated[float, Meta(gt=0), setting("seconds between stats log lines while busy")] = 5.0
    metrics_port: Annotated[Port | None, setting(
        "serve Prometheus metrics on http://127.0.0.1:PORT/metrics (default: off)")] = None
    kv_events_endpoint: Annotated[str | None, setting(
        "publish KV cache events (block stored / removed / all cleared) on this ZeroMQ PUB address, "
        "e.g. tcp://127.0.0.1:5557 (default: off)")] = None
    kv_events_replay_endpoint: Annotated[str | None, setting(
        "ZeroMQ address where late subscribers fetch missed event batches (bounded buffer)")] = None
    max_pending_requests: Annotated[PositiveInt, setting(
        "most requests in flight over all clients; more get an error output 'server overloaded'")] = 4096
    max_client_requests: Annotated[PositiveInt, setting(
        "most requests in flight from one client connection; more get an error output 'server overloaded'")] = 1024
    api_key: Annotated[str | None, setting(
        "HTTP API: every route but /health and /version needs `Authorization: Bearer KEY`; several keys separated "
        "by commas, each key a user of its own. Default: the environment variable KVENGINE_API_KEY (which keeps "
        "the key out of the process list), else no key: every route is open")] = None
    admin_api_key: Annotated[str | None, setting(
        "HTTP API: the key of /reset_prefix_cache, which an --api-key does not open (with an --api-key and no admin "
        "key it is refused). Default: the environment variable KVENGINE_ADMIN_API_KEY")] = None
    cache_salt_per_api_key: Annotated[bool, setting(
        "HTTP API: salt the prefix cache with a digest of each request's API key, so that no key's requests hit "
        "(or learn of) another key's cached prefixes; needs --api-key or KVENGINE_API_KEY")] = False
    max_request_body_bytes: Annotated[PositiveInt, setting(
        "HTTP API: the largest request body; a larger one gets 413 before it is read", parse="bytes")] = 8 << 20
    max_request_prompts: Annotated[PositiveInt, setting(
        "HTTP API: most prompts in one /v1/completions request; more get 400")] = 1024
    max_user_requests: Annotated[PositiveInt, setting(
        "HTTP API: most prompts in flight per user (an API key, or a connection with no keys) in one API process, "
        "a request of N prompts counting N; more get 429")] = 1024
    max_http_connections: Annotated[PositiveInt, setting(
        "HTTP API: most open connections per API process; past it a new connection closes the longest-open idle "
        "one, or is refused with 503 when none is idle")] = 512
    http_keep_alive_timeout: Annotated[float, Meta(gt=0), setting(
        "HTTP API: seconds an idle keep-alive connection stays open")] = 5.0
    http_header_timeout: Annotated[float, Meta(gt=0), setting(
        "HTTP API: seconds for a request's line and headers to arrive, from the connection's opening or the "
        "previous response; the connection is closed after them")] = 10.0
    http_body_timeout: Annotated[float, Meta(gt=0), setting(
        "HTTP API: seconds for a request's whole body to arrive once its headers have; 408 after them")] = 30.0
    log_level: Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], setting("log level")] = "INFO"

    def __post_init__(self) -> None:
        keys = self.http_api_keys()
        admin = self.http_admin_key()
        for key in [*keys, *([admin] if admin is not None else [])]:
            if not key or not key.isascii() or not key.isprintable() or " " in key:
                raise ValueError("an API key is printable ASCII without spaces (several are separated by commas)")
        if self.cache_salt_per_api_key and not keys:
            raise ValueError(f"cache_salt_per_api_key salts by API key: give --api-key or {API_KEY_ENV}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice finds the model's calls with a parser: give --tool-call-parser")

    def client_address(self) -> str | None:
        """--address, else None (the server picks an ipc:// path)."""
        return self.address

    def http_api_keys(self) -> list[str]:
        """--api-key, else KVENGINE_API_KEY, split at commas (none: every HTTP route is open)."""
        keys = self.api_key if self.api_key is not None else os.environ.get(API_KEY_ENV) or None
        return [] if keys is None else keys.split(",")

    def http_admin_key(self) -> str | None:
        return self.admin_api_key if self.admin_api_key is not None else os.environ.get(ADMIN_API_KEY_ENV) or None


class EngineConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    cache: CacheConfig = msgspec.field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = msgspec.field(default_factory=ParallelConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        for area in AREAS:  # the Meta ranges, which msgspec checks on decode but not on construction
            value = getattr(self, area)
            try:
                msgspec.convert(msgspec.to_builtins(value), type(value))
            except msgspec.ValidationError as e:
                raise ValueError(f"invalid setting: {str(e).replace('$', area)}") from None
        budgets = self.cache.kv_cache_memory_bytes
        tp = self.parallel.tensor_parallel_size
        if budgets is not None and len(budgets) not in (1, tp):
            raise ValueError(f"kv_cache_memory_bytes takes one value or {tp} (one per rank), got {len(budgets)}")
        parallel = self.parallel
        if tp % parallel.nnodes:
            raise ValueError(f"tensor_parallel_size {tp} does not split evenly over nnodes {parallel.nnodes}")
        if parallel.node_rank >= parallel.nnodes:
            raise ValueError(f"node_rank {parallel.node_rank} is outside nnodes {parallel.nnodes}")
        _check_kv_tier(self)
        if parallel.headless != (parallel.node_rank > 0):
            raise ValueError("a host with node_rank >= 1 runs --headless (workers only); the head (node_rank 0) "
                             "runs the engine core")

    def kv_cache_memory_bytes_of(self, rank: int) -> int | None:
        budgets = self.cache.kv_cache_memory_bytes
        return None if budgets is None else budgets[rank % len(budgets)]

    @property
    def enable_kv_cache_events(self) -> bool:
        return self.server.kv_events_endpoint is not None


def _check_kv_tier(config: EngineConfig) -> None:
    """The disk tier's needs, each refused by the flag that asks for it."""
    cache = config.cache
    if config.scheduler.preemption_mode == "swap" and cache.kv_disk_path is None:
        raise ValueError("preemption_mode swap puts preempted requests' blocks in the disk tier: give kv_disk_path")
    if cache.kv_disk_path is None:
        if cache.kv_disk_bytes is not None:
            raise ValueError("kv_disk_bytes bounds the disk tier: give kv_disk_path too")
        return
    if not cache.enable_prefix_caching:
        raise ValueError("kv_disk_path finds blocks by their prefix-cache hashes: it needs enable_prefix_caching")
    if config.parallel.nnodes > 1:
        raise ValueError("kv_disk_path: the disk tier needs every tensor-parallel rank on this host (nnodes 1): the "
                         "engine core reads each rank's index")


def engine_config(**settings: object) -> EngineConfig:
    """EngineConfig from flat field names (block_size=32, max_num_seqs=8), each placed in its area."""
    areas: dict[str, dict[str, object]] = {area: {} for area in AREAS}
    for name, value in settings.items():
        area = AREA_OF.get(name)
        if area is None:
            raise TypeError(f"no engine setting named {name!r}")
        areas[area][name] = value
    # Each area by its field name, of its field's type: a pairing mypy cannot follow through str keys.
    built: dict[str, Any] = {area: AREA_TYPES[area](**values) for area, values in areas.items()}
    return EngineConfig(**built)


AREA_TYPES: dict[str, type[msgspec.Struct]] = {f.name: f.type for f in msgspec.structs.fields(EngineConfig)}
AREAS = tuple(AREA_TYPES)
AREA_OF = {f.name: area for area, t in AREA_TYPES.items() for f in msgspec.structs.fields(t)}


def with_settings(config: EngineConfig, **settings: object) -> EngineConfig:
    """config with some settings replaced, by flat field name (as engine_config takes them)."""
    areas: dict[str, dict[str, object]] = {}
    for name, value in settings.items():
        areas.setdefault(AREA_OF[name], {})[name] = value
    replaced = {area: msgspec.structs.replace(getattr(config, area), **values) for area, values in areas.items()}
    return msgspec.structs.replace(config, **replaced)
