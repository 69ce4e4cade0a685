"""Trace replay: the real EngineCore (scheduler + KV ledger) on a simulated clock, no model.

Used by `kvengine simulate` for capacity planning ("how many KV blocks for this traffic, and what
prefix-cache hit rate?"). Pieces, in the order a replay uses them:

- `read_trace`: Mooncake-format JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`
  of 512-token blocks, the last one possibly partial).
- `TokenSynthesizer`: each hash id becomes 512 pseudo-random token ids, a keyed SHAKE-128 stream of
  (seed, id), the last block of a prompt truncated to the remainder. Equal ids give equal tokens and
  different ids give unrelated ones, so the engine's own chained block hashes find exactly the
  sharing the trace records at any block size that divides 512. Token ids are 31-bit (int32 >= 0),
  so even tiny block sizes do not collide by chance. Prompts are made when a request enters the
  engine and dropped when it finishes; only a bounded LRU of per-id blocks is kept.
- `count_prefix_hits`: the infinite-cache ceiling counted directly over hash ids (a trie of block
  chains), at the engine's block size, never covering the last prompt token.
- `SimExecutor`: a model-free executor that follows the SchedulerOutput protocol (new, running,
  preempted and finished requests; tokens count once scheduled; a token is sampled when a request
  has computed all its known tokens) but keeps only two integers per request, no block tables and
  no token histories. Sampled tokens depend only on the position (so recompute after preemption
  regenerates the same tokens) and are never EOS. It also prices each step with the cost model.
  With `check=True` every step is also run through ReferenceExecutor, which rebuilds block tables and
  token histories and raises on any protocol mismatch (slower; for tests and debugging).
- `replay`: the loop. Requests enter the engine at their (scaled) arrival times; the clock advances
  by the cost of each step, or jumps to the next arrival when the engine is idle.

The waiting queue is fed lazily: an arrived request enters the engine only while the engine's own
waiting queue holds fewer than `max_num_seqs` requests. Under FCFS the scheduler admits at most
max_num_seqs requests per step, strictly from the head of the queue, so this gives the same
schedule as adding every arrival at once, while keeping at most running + max_num_seqs prompts
alive (an overloaded replay would otherwise hold thousands of 12k-token prompts).

Cost model (seconds, per step that runs): decode_cost_per_step
  + prefill_cost_per_token * (scheduled tokens that are already known: prompt, or output being recomputed)
  + cost_per_decode_token * (scheduled tokens that produce a new token after the prompt).
The defaults (5 ms, 10 us, 100 us) are a rough 8B-class model on a few H100-class GPUs: 100k
prefill tokens/s (the conversation trace asks for about 41k prompt tokens/s before any cache hit,
so a replay at its own rate keeps up), and a 64-request decode step of about 11 ms. They only shape
the simulated clock (TTFT, and through queueing which requests run together, hence how long a
cached prefix survives); tune them with the flags to model your hardware.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace

from engine_core.config import SchedulerConfig
from engine_core.core import EngineCore
from engine_core.reference_executor import ReferenceExecutor
from protocol import (
    EngineCoreRequest,
    FullAttentionSpec,
    KVCacheConfig,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
    WorkerKVReport,
)

TRACE_BLOCK_TOKENS = 512  # Mooncake hash ids cover 512 tokens each
VOCAB_SIZE = 1 << 31  # synthetic token ids are non-negative int32

DEFAULT_PREFILL_COST_PER_TOKEN = 10e-6
DEFAULT_DECODE_COST_PER_STEP = 5e-3
DEFAULT_COST_PER_DECODE_TOKEN = 100e-6


# ---- trace ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # position in the trace file (the request id is "req-<index>")
    timestamp: float  # ms from the start of the trace
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class TraceError(ValueError):
    """The trace file is malformed; the message names the line."""


def parse_trace_lines(lines: Iterable[str], limit: int | None = None, source: str = "trace") -> list[TraceRequest]:
    """Parse Mooncake JSONL, check every record, and order by arrival (stable for equal timestamps)."""
    out: list[TraceRequest] = []
    for lineno, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
            ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
        except (ValueError, KeyError, TypeError) as e:
            raise TraceError(f"{source}:{lineno}: not a Mooncake trace record ({e})") from None
        if not (isinstance(n_in, int) and n_in >= 1 and isinstance(n_out, int) and n_out >= 0):
            raise TraceError(f"{source}:{lineno}: input_length must be >= 1 and output_length >= 0")
        if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
            raise TraceError(f"{source}:{lineno}: hash_ids must be a list of integers")
        if len(ids) != -(-n_in // TRACE_BLOCK_TOKENS):
            raise TraceError(
                f"{source}:{lineno}: {len(ids)} hash ids for input_length {n_in} "
                f"(expected {-(-n_in // TRACE_BLOCK_TOKENS)} blocks of {TRACE_BLOCK_TOKENS} tokens)"
            )
        out.append(TraceRequest(len(out), float(ts), n_in, n_out, tuple(ids)))
    out.sort(key=lambda r: r.timestamp)  # stable: file order breaks ties
    return out


def read_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    with open(path) as f:
        return parse_trace_lines(f, limit, path)


# ---- token synthesis -----------------------------------------------------------------------------


class TokenSynthesizer:
    """hash id -> 512 token ids, deterministic in (seed, id); a bounded LRU of packed blocks."""

    def __init__(self, seed: int = 0, cache_size: int = 1 << 15) -> None:
        self.seed = seed
        self.cache_size = cache_size
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._msb = 3 if sys.byteorder == "little" else 0  # byte holding the sign bit of an int32
        self._clear_sign = bytes(b & 0x7F for b in range(256))

    def block_bytes(self, hash_id: int) -> bytes:
        """512 packed non-negative int32 token ids (native byte order)."""
        cached = self._cache.get(hash_id)
        if cached is not None:
            self._cache.move_to_end(hash_id)
            return cached
        key = b"kvengine-sim" + self.seed.to_bytes(8, "little", signed=True) + hash_id.to_bytes(16, "little", signed=True)
        raw = bytearray(hashlib.shake_128(key).digest(4 * TRACE_BLOCK_TOKENS))
        raw[self._msb :: 4] = raw[self._msb :: 4].translate(self._clear_sign)
        data = bytes(raw)
        self._cache[hash_id] = data
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return data

    def block_tokens(self, hash_id: int) -> list[int]:
        return array("i", self.block_bytes(hash_id)).tolist()

    def prompt(self, request: TraceRequest) -> list[int]:
        packed = b"".join(self.block_bytes(h) for h in request.hash_ids)
        return array("i", packed[: 4 * request.input_length]).tolist()


# ---- infinite-cache ceiling by direct count ------------------------------------------------------


def count_prefix_hits(requests: Sequence[TraceRequest], block_size: int) -> list[int]:
    """Per request (in the order given), the prefix-cache hit in tokens with an infinite cache.

    A trie of hash-id chains remembers, per chain, the most tokens of its last 512-block any earlier
    request had (512 for a full block, the remainder for a partial last one). A request hits whole
    blocks while an earlier request had the same chain and at least as many tokens of the block, plus
    the overlap of the first block that earlier requests only had partially. The hit is capped at
    input_length - 1 (a hit never covers the last prompt token) and rounded down to block_size: the
    engine caches whole blocks of block_size tokens only.
    """
    if TRACE_BLOCK_TOKENS % block_size:
        raise ValueError(f"block size {block_size} must divide {TRACE_BLOCK_TOKENS}")
    children: dict[tuple[int, int], int] = {}
    seen: list[int] = [TRACE_BLOCK_TOKENS]  # node 0: the empty chain
    hits = []
    for req in requests:
        n_in = req.input_length
        hit, node = 0, 0
        for j, h in enumerate(req.hash_ids):
            child = children.get((node, h))
            if child is None:
                break
            block_len = min(TRACE_BLOCK_TOKENS, n_in - j * TRACE_BLOCK_TOKENS)
            have = seen[child]
            hit += min(have, block_len)
            if have < block_len:
                break
            node = child
        hits.append(min(hit, n_in - 1) // block_size * block_size)
        node = 0
        for j, h in enumerate(req.hash_ids):
            block_len = min(TRACE_BLOCK_TOKENS, n_in - j * TRACE_BLOCK_TOKENS)
            child = children.get((node, h))
            if child is None:
                child = children[(node, h)] = len(seen)
                seen.append(block_len)
            elif seen[child] < block_len:
                seen[child] = block_len
            node = child
    return hits


# ---- the executor --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    prefill_cost_per_token: float = DEFAULT_PREFILL_COST_PER_TOKEN
    decode_cost_per_step: float = DEFAULT_DECODE_COST_PER_STEP
    cost_per_decode_token: float = DEFAULT_COST_PER_DECODE_TOKEN

    def step_cost(self, num_prefill_tokens: int, num_decode_tokens: int) -> float:
        return (
            self.decode_cost_per_step
            + self.prefill_cost_per_token * num_prefill_tokens
            + self.cost_per_decode_token * num_decode_tokens
        )


def sim_next_token(position: int) -> int:
    """The token sampled at this position: depends on nothing else, so recompute regenerates it."""
    return (position * 2654435761 + 12345) % VOCAB_SIZE


class SimExecutor:
    """Follows SchedulerOutputs like a worker, minus the work a replay does not need (see module doc)."""

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        max_model_len: int,
        cost_model: CostModel | None = None,
        check: bool = False,
    ) -> None:
        self.spec = FullAttentionSpec(block_size, 1, 8, 2)
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.cost_model = cost_model or CostModel()
        # request id -> [tokens known when (re)scheduled as new, tokens known now, tokens computed]
        self.state: dict[str, list[int]] = {}
        self.reference = (
            ReferenceExecutor(
                [num_blocks * self.spec.page_size_bytes], {"layer.0": self.spec}, VOCAB_SIZE, [], max_model_len
            )
            if check
            else None
        )
        self.num_steps = 0  # steps that computed tokens
        self.last_cost = 0.0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.on_execute: Callable[[], None] | None = None  # called before each step's work (usage sampling)

    def determine_available_memory(self) -> list[WorkerKVReport]:
        return [
            WorkerKVReport(
                rank=0,
                available_kv_bytes=self.num_blocks * self.spec.page_size_bytes,
                kv_cache_specs={"layer.0": self.spec},
                eos_token_ids=[],
                max_position_embeddings=self.max_model_len,
                vocab_size=VOCAB_SIZE,
                memory_detail="simulated: fixed block count",
            )
        ]

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        if self.reference is not None:
            self.reference.initialize_kv_cache(kv_cache_config)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.on_execute is not None:
            self.on_execute()
        state = self.state
        for req_id in so.finished_req_ids:
            state.pop(req_id, None)
        for req_id in so.preempted_req_ids:
            state.pop(req_id, None)
        if not so.total_num_scheduled_tokens:  # a step that only tells workers of finished/preempted ids
            self.last_cost = 0.0
            if self.reference is not None:
                self.reference.execute_model(so)
            return ModelRunnerOutput(step=so.step, req_ids=[], sampled_token_ids=[])
        for new in so.scheduled_new_reqs:
            known = len(new.prompt_token_ids) + len(new.output_token_ids)
            state[new.req_id] = [known, known, new.num_computed_tokens]
        req_ids, sampled = [], []
        prefill = decode = 0
        for req_id, n in so.num_scheduled_tokens.items():
            st = state[req_id]
            prefill_end, known, computed = st
            end = computed + n
            if computed < prefill_end:
                p = min(end, prefill_end) - computed
                prefill += p
                decode += n - p
            else:
                decode += n
            st[2] = end
            req_ids.append(req_id)
            if end == known:
                sampled.append([sim_next_token(known)])
                st[1] = known + 1
            else:
                sampled.append([])
        self.num_steps += 1
        self.num_prefill_tokens += prefill
        self.num_decode_tokens += decode
        self.last_cost = self.cost_model.step_cost(prefill, decode)
        if self.reference is not None:
            ref = self.reference.execute_model(so)
            if ref.req_ids != req_ids or [len(t) for t in ref.sampled_token_ids] != [len(t) for t in sampled]:
                raise RuntimeError(f"step {so.step}: SimExecutor and ReferenceExecutor sample different requests")
        return ModelRunnerOutput(step=so.step, req_ids=req_ids, sampled_token_ids=sampled)

    def shutdown(self) -> None:
        pass


# ---- the replay ----------------------------------------------------------------------------------


@dataclass
class SimConfig:
    block_size: int = 16
    kv_cache_tokens: int | None = None  # usable tokens; ignored when num_gpu_blocks_override is set
    num_gpu_blocks_override: int | None = None  # all blocks, the null block included
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the longest request of the trace (capped by the pool)
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    time_scale: float = 1.0  # arrival times are multiplied by this (0.5 = twice the rate)
    as_fast_as_possible: bool = False  # ignore timestamps: everything arrives at t=0, in trace order
    cost_model: CostModel = field(default_factory=CostModel)
    output_len_cap: int | None = None
    seed: int = 0
    check_executor: bool = False  # also run ReferenceExecutor and compare (slow)

    def __post_init__(self) -> None:
        if self.block_size < 1 or TRACE_BLOCK_TOKENS % self.block_size:
            raise ValueError(f"--block-size must divide {TRACE_BLOCK_TOKENS}, got {self.block_size}")
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be positive")
        if self.output_len_cap is not None and self.output_len_cap < 1:
            raise ValueError("--output-len-cap must be at least 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"--kv-cache-tokens must be at least one block ({self.block_size} tokens)")

    def max_tokens(self, req: TraceRequest) -> int:
        n = max(req.output_length, 1)
        return min(n, self.output_len_cap) if self.output_len_cap else n


def infinite_num_blocks(requests: Sequence[TraceRequest], config: SimConfig, hits: Sequence[int]) -> int:
    """A pool that never evicts: every block any request can ever allocate, plus the null block.

    With no eviction a request allocates cdiv(its tokens, block_size) minus its prefix-hit blocks;
    the sum over requests bounds the blocks that ever hold data, so the free queue never has to hand
    out a cached block. Twice the largest request is added as slack for a lower hit than counted.
    """
    bs = config.block_size
    total, largest = 1, 0
    for req, hit in zip(requests, hits):
        n = -(-(req.input_length + config.max_tokens(req)) // bs)
        total += n - hit // bs
        largest = max(largest, n)
    return total + 2 * largest


@dataclass
class SimResult:
    num_requests: int
    num_finished: int
    num_rejected: int
    num_prompt_tokens: int
    num_cached_tokens: int  # prefix hits at first admission, summed (rejected requests count 0)
    hit_rate: float
    ceiling_cached_tokens: int  # direct count, infinite cache
    ceiling_hit_rate: float
    num_output_tokens: int
    num_preemptions: int
    num_steps: int
    num_prefill_tokens_computed: int
    num_decode_tokens_computed: int
    num_blocks: int
    kv_cache_tokens: int  # usable: (num_blocks - 1) * block_size
    block_size: int
    max_model_len: int
    peak_kv_usage: float
    mean_kv_usage: float  # weighted by simulated step time
    sim_time_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    wall_time_s: float
    free_blocks_at_end: int
    hash_algo: str
    prefix_caching: bool
    per_request_cached_tokens: list[int] | None = None  # trace order of arrival; -1 when rejected

    def checks(self) -> list[str]:
        """Problems the replay must not have; empty when all is well."""
        problems = []
        if self.num_finished + self.num_rejected != self.num_requests:
            problems.append(f"only {self.num_finished + self.num_rejected} of {self.num_requests} requests finished")
        if self.free_blocks_at_end != self.num_blocks - 1:
            problems.append(f"pool ends with {self.free_blocks_at_end} free blocks, expected {self.num_blocks - 1}")
        if self.num_cached_tokens > self.ceiling_cached_tokens:
            problems.append("more prefix hits than the infinite-cache ceiling")
        return problems

    def to_dict(self, per_request: bool = False) -> dict:
        d = asdict(self)
        if not per_request:
            d.pop("per_request_cached_tokens")
        return d


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile of an ascending list (None when empty)."""
    if not sorted_values:
        return None
    k = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[k]


def resolve_num_blocks(config: SimConfig, requests: Sequence[TraceRequest], ceiling_hits: Sequence[int]) -> int:
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if config.kv_cache_tokens is not None:
        return config.kv_cache_tokens // config.block_size + 1
    return infinite_num_blocks(requests, config, ceiling_hits)


def replay(
    requests: Sequence[TraceRequest],
    config: SimConfig,
    progress: bool | Callable[[int], object] = False,
    ceiling_hits: Sequence[int] | None = None,
    synthesizer: TokenSynthesizer | None = None,
    keep_per_request: bool = False,
) -> SimResult:
    """Replay the trace through a real EngineCore. Without a KV size the pool never evicts.

    progress: True for a tqdm bar on stderr, or a callable given the number of requests just done.
    """
    wall_start = time.perf_counter()
    requests = list(requests)
    bs = config.block_size
    if ceiling_hits is None:
        ceiling_hits = count_prefix_hits(requests, bs)
    num_blocks = resolve_num_blocks(config, requests, ceiling_hits)
    usable_tokens = (num_blocks - 1) * bs
    longest = max((r.input_length + config.max_tokens(r) for r in requests), default=1)
    max_model_len = config.max_model_len or max(1, min(longest, usable_tokens))
    synthesizer = synthesizer or TokenSynthesizer(config.seed)

    executor = SimExecutor(bs, num_blocks, max_model_len, config.cost_model, config.check_executor)
    sched_config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        block_size=bs,
        enable_prefix_caching=config.enable_prefix_caching,
        prefix_cache_hash=config.prefix_caching_hash_algo,
        num_gpu_blocks_override=num_blocks,
    )
    core = EngineCore(sched_config, executor)
    scheduler = core.scheduler
    pool = scheduler.kv_cache_manager.block_pool
    waiting = scheduler.waiting
    denominator = num_blocks - 1

    usage_stats = [0.0, 0.0]  # peak, sum of usage * step time (set after each step)
    current_usage = [0.0]

    def sample_usage() -> None:  # after schedule() allocated this step's blocks, before any finish
        u = 1.0 - pool.get_num_free_blocks() / denominator
        current_usage[0] = u
        if u > usage_stats[0]:
            usage_stats[0] = u

    executor.on_execute = sample_usage

    n = len(requests)
    scale = 0.0 if config.as_fast_as_possible else config.time_scale / 1000.0
    arrivals = [r.timestamp * scale for r in requests]
    by_id: dict[str, int] = {}
    cached = [-1] * n
    ttfts: list[float] = []
    first_token_seen = [False] * n
    num_finished = num_rejected = num_output_tokens = 0
    clock = 0.0
    next_i = 0
    lookahead = config.max_num_seqs

    bar = None
    report: Callable[[int], object] | None = None
    if progress is True:
        from tqdm import tqdm

        bar = tqdm(total=n, unit="req", desc=f"simulate {usable_tokens:,} tokens", dynamic_ncols=True, file=sys.stderr)
        report = bar.update
    elif callable(progress):
        report = progress

    try:
        while True:
            while next_i < n and arrivals[next_i] <= clock and len(waiting) < lookahead:
                req = requests[next_i]
                if req.input_length > max_model_len:
                    # The scheduler would reject it on length alone; skip synthesising its prompt.
                    num_rejected += 1
                    next_i += 1
                    if report is not None:
                        report(1)
                    continue
                rid = f"req-{req.index}"
                by_id[rid] = next_i
                core.add_request(
                    EngineCoreRequest(
                        rid,
                        synthesizer.prompt(req),
                        SamplingParams(max_tokens=config.max_tokens(req), ignore_eos=True, temperature=0.0),
                        arrivals[next_i],
                    )
                )
                next_i += 1
            if not core.has_work():
                if next_i >= n:
                    break
                clock = max(clock, arrivals[next_i])
                continue
            steps_before = executor.num_steps
            outputs = core.step().outputs
            ran = executor.num_steps != steps_before
            if ran:
                dt = executor.last_cost
                clock += dt
                usage_stats[1] += current_usage[0] * dt
            done = 0
            for out in outputs:
                i = by_id[out.request_id]
                if out.new_token_ids:
                    num_output_tokens += len(out.new_token_ids)
                    if not first_token_seen[i]:
                        first_token_seen[i] = True
                        ttfts.append(clock - arrivals[i])
                if out.finish_reason is not None:
                    del by_id[out.request_id]
                    done += 1
                    if out.finish_reason == "error":
                        num_rejected += 1
                    else:
                        num_finished += 1
                        cached[i] = out.num_cached_tokens
            if done and report is not None:
                report(done)
            if not ran and not outputs and core.has_work():
                # Nothing could be scheduled: only a later arrival can change that.
                if next_i < n and arrivals[next_i] > clock and len(waiting) < lookahead:
                    clock = arrivals[next_i]
                else:
                    raise RuntimeError(
                        f"replay stalled at t={clock:.3f}s: {len(scheduler.running)} running, "
                        f"{len(waiting)} waiting, {pool.get_num_free_blocks()} free blocks"
                    )
    finally:
        if bar is not None:
            bar.close()

    # The last step's finished ids reach the executor with the next step; flush them.
    executor.state.clear()
    num_prompt = sum(r.input_length for r in requests)
    num_cached = sum(c for c in cached if c > 0)
    ceiling = sum(ceiling_hits)
    ttfts.sort()
    return SimResult(
        num_requests=n,
        num_finished=num_finished,
        num_rejected=num_rejected,
        num_prompt_tokens=num_prompt,
        num_cached_tokens=num_cached,
        hit_rate=num_cached / num_prompt if num_prompt else 0.0,
        ceiling_cached_tokens=ceiling,
        ceiling_hit_rate=ceiling / num_prompt if num_prompt else 0.0,
        num_output_tokens=num_output_tokens,
        num_preemptions=scheduler.num_preemptions,
        num_steps=executor.num_steps,
        num_prefill_tokens_computed=executor.num_prefill_tokens,
        num_decode_tokens_computed=executor.num_decode_tokens,
        num_blocks=num_blocks,
        kv_cache_tokens=usable_tokens,
        block_size=bs,
        max_model_len=max_model_len,
        peak_kv_usage=usage_stats[0],
        mean_kv_usage=usage_stats[1] / clock if clock > 0 else 0.0,
        sim_time_s=clock,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        wall_time_s=time.perf_counter() - wall_start,
        free_blocks_at_end=pool.get_num_free_blocks(),
        hash_algo=config.prefix_caching_hash_algo,
        prefix_caching=config.enable_prefix_caching,
        per_request_cached_tokens=cached if keep_per_request else None,
    )


# ---- sweep ---------------------------------------------------------------------------------------


def log_spaced(lo: float, hi: float, points: int) -> list[int]:
    if points < 1 or lo <= 0 or hi < lo:
        raise ValueError("a sweep needs 0 < min <= max and at least one point")
    if points == 1:
        return [int(lo)]
    ratio = (hi / lo) ** (1 / (points - 1))
    return sorted({int(round(lo * ratio**k)) for k in range(points)})


def sweep(
    requests: Sequence[TraceRequest],
    config: SimConfig,
    capacities_tokens: Sequence[int],
    progress: bool = False,
    on_result: Callable[[SimResult], object] | None = None,
) -> list[SimResult]:
    """One replay per cache size (usable tokens), smallest first; the ceiling is counted once."""
    hits = count_prefix_hits(requests, config.block_size)
    synthesizer = TokenSynthesizer(config.seed)
    results = []
    for tokens in sorted(capacities_tokens):
        cfg = replace(config, kv_cache_tokens=max(int(tokens), config.block_size), num_gpu_blocks_override=None)
        if config.max_model_len is not None:  # a fixed length the pool cannot hold would fail start-up
            cfg = replace(cfg, max_model_len=min(config.max_model_len, cfg.kv_cache_tokens // cfg.block_size * cfg.block_size))
        result = replay(requests, cfg, progress=progress, ceiling_hits=hits, synthesizer=synthesizer)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def monotonic_violations(results: Sequence[SimResult], tolerance: float = 0.0) -> list[str]:
    """Sweep points where a larger cache gave a lower hit rate."""
    out = []
    ordered = sorted(results, key=lambda r: r.kv_cache_tokens)
    for a, b in zip(ordered, ordered[1:]):
        if b.hit_rate < a.hit_rate - tolerance:
            out.append(
                f"hit rate falls from {a.hit_rate:.4%} at {a.kv_cache_tokens:,} tokens "
                f"to {b.hit_rate:.4%} at {b.kv_cache_tokens:,} tokens"
            )
    return out


__all__ = [
    "CostModel",
    "SimConfig",
    "SimExecutor",
    "SimResult",
    "TokenSynthesizer",
    "TraceError",
    "TraceRequest",
    "count_prefix_hits",
    "infinite_num_blocks",
    "log_spaced",
    "monotonic_violations",
    "parse_trace_lines",
    "percentile",
    "read_trace",
    "replay",
    "sweep",
]
