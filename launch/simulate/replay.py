"""The replay: a trace through a real EngineCore. Requests enter the engine at their (scaled) arrival
times; the clock advances by the cost of each step, or jumps to the next arrival when the engine is
idle. Without a KV size the pool is large enough never to evict.

The waiting queue is fed lazily: an arrived request enters the engine only while the engine's own
waiting queue holds fewer than `max_num_seqs` requests. Under FCFS the scheduler admits at most
max_num_seqs requests per step, strictly from the head of the queue, so this gives the same
schedule as adding every arrival at once, while keeping at most running + max_num_seqs prompts
alive (an overloaded replay would otherwise hold thousands of 12k-token prompts).
"""

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from engine_core.core import EngineCore
from launch.commands.percentiles import percentile
from launch.simulate.ceiling import count_prefix_hits
from launch.simulate.executor import CostModel, SimExecutor
from launch.simulate.result import SimResult
from launch.simulate.tier import SimDiskTier, TierModel
from launch.simulate.tokens import TokenSynthesizer
from launch.simulate.trace import TraceRequest, check_block_size
from protocol import EngineCoreOutput, EngineCoreRequest, SamplingParams
from protocol.config import EngineConfig, with_settings


@dataclass(frozen=True)
class SimConfig:
    """What a replay needs beyond the engine's settings (those stay in the EngineConfig)."""

    kv_cache_tokens: int | None = None  # usable tokens; ignored when num_gpu_blocks_override is set
    time_scale: float = 1.0  # arrival times are multiplied by this (0.5 = twice the rate)
    as_fast_as_possible: bool = False  # ignore timestamps: everything arrives at t=0, in trace order
    cost_model: CostModel = field(default_factory=CostModel)
    output_len_cap: int | None = None
    seed: int = 0
    check_executor: bool = False  # also run ReferenceExecutor and compare (slow)
    kv_disk: TierModel | None = None  # a disk tier behind the memory cache (launch/simulate/tier.py)

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("--time-scale must be positive")
        if self.output_len_cap is not None and self.output_len_cap < 1:
            raise ValueError("--output-len-cap must be at least 1")

    def max_tokens(self, req: TraceRequest) -> int:
        n = max(req.output_length, 1)
        return min(n, self.output_len_cap) if self.output_len_cap else n


def check_settings(config: EngineConfig, sim: SimConfig) -> None:
    """Raise ValueError for settings a replay cannot run with."""
    block_size = config.cache.block_size
    check_block_size(block_size)
    if sim.kv_cache_tokens is not None and sim.kv_cache_tokens < block_size:
        raise ValueError(f"--kv-cache-tokens must be at least one block ({block_size} tokens)")


def infinite_num_blocks(requests: Sequence[TraceRequest], sim: SimConfig, block_size: int, hits: Sequence[int]) -> int:
    """A pool that never evicts: every block any request can ever allocate, plus the null block.

    With no eviction a request allocates cdiv(its tokens, block_size) minus its prefix-hit blocks;
    the sum over requests bounds the blocks that ever hold data, so the free queue never has to hand
    out a cached block. Twice the largest request is added as slack for a lower hit than counted.
    """
    total, largest = 1, 0
    for req, hit in zip(requests, hits, strict=True):
        n = -(-(req.input_length + sim.max_tokens(req)) // block_size)
        total += n - hit // block_size
        largest = max(largest, n)
    return total + 2 * largest


def pool_size(
    config: EngineConfig, sim: SimConfig, requests: Sequence[TraceRequest], hits: Sequence[int]
) -> tuple[int, int]:
    """(num_blocks, max_model_len) of the replay: num_gpu_blocks_override, else --kv-cache-tokens, else a
    pool that never evicts; max_model_len as set, else the longest request, capped by the pool."""
    bs = config.cache.block_size
    num_blocks = config.cache.num_gpu_blocks_override
    if num_blocks is None:
        if sim.kv_cache_tokens is not None:
            num_blocks = sim.kv_cache_tokens // bs + 1
        else:
            num_blocks = infinite_num_blocks(requests, sim, bs, hits)
    longest = max((r.input_length + sim.max_tokens(r) for r in requests), default=1)
    return num_blocks, config.model.max_model_len or max(1, min(longest, (num_blocks - 1) * bs))


class Replay:
    """One replay of a trace (see the module doc): build it, then `run` it once."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        config: EngineConfig,
        sim: SimConfig | None = None,
        ceiling_hits: Sequence[int] | None = None,
        synthesizer: TokenSynthesizer | None = None,
    ) -> None:
        self.wall_start = time.perf_counter()  # the wall time includes building the pool
        self.requests = list(requests)
        self.sim = sim = sim or SimConfig()
        check_settings(config, sim)
        bs = config.cache.block_size
        self.ceiling_hits = list(ceiling_hits) if ceiling_hits is not None else count_prefix_hits(self.requests, bs)
        self.num_blocks, self.max_model_len = pool_size(config, sim, self.requests, self.ceiling_hits)
        self.config = with_settings(config, num_gpu_blocks_override=self.num_blocks, max_model_len=self.max_model_len)
        self.synthesizer = synthesizer or TokenSynthesizer(sim.seed)
        self.tier = None if sim.kv_disk is None else SimDiskTier(sim.kv_disk, bs)
        self.executor = SimExecutor(bs, self.num_blocks, self.max_model_len, sim.cost_model, sim.check_executor,
                                    self.tier)
        self.executor.on_execute = self._sample_usage
        self.core = EngineCore(self.config, self.executor, None if self.tier is None else self.tier.connector)
        self.scheduler = self.core.scheduler
        self.pool = self.scheduler.kv_cache_manager.block_pool
        scale = 0.0 if sim.as_fast_as_possible else sim.time_scale / 1000.0
        self.arrivals = [r.timestamp * scale for r in self.requests]
        self.lookahead = self.config.scheduler.max_num_seqs
        self.clock = 0.0
        self.next_i = 0  # trace position of the next request to arrive
        self.by_id: dict[str, int] = {}  # request id in the engine -> trace position
        self.cached = [-1] * len(self.requests)  # prefix hit per request, once finished
        self.has_first_token = [False] * len(self.requests)
        self.ttfts: list[float] = []
        self.num_finished = self.num_rejected = self.num_output_tokens = 0
        self.usage = self.peak_usage = self.usage_seconds = 0.0  # usage_seconds: usage integrated over time
        self.report: Callable[[int], object] | None = None

    def run(self, progress: bool | Callable[[int], object] = False, keep_per_request: bool = False) -> SimResult:
        """progress: True for a tqdm bar on stderr, or a callable given the number of requests just done."""
        bar = self._open_progress(progress)
        try:
            while self._turn():
                pass
        finally:
            if bar is not None:
                bar.close()
        self.executor.state.clear()  # the last step's finished ids would reach the executor with the next step
        return self._result(time.perf_counter() - self.wall_start, keep_per_request)

    def _open_progress(self, progress: bool | Callable[[int], object]) -> tqdm | None:
        if callable(progress):
            self.report = progress
        if progress is not True:
            return None
        usable = (self.num_blocks - 1) * self.config.cache.block_size
        bar = tqdm(total=len(self.requests), unit="req", desc=f"simulate {usable:,} tokens", dynamic_ncols=True,
                   file=sys.stderr)
        self.report = bar.update
        return bar

    def _turn(self) -> bool:
        """Admit what has arrived, then run one step or move the clock; False once the trace is done."""
        self._admit_arrivals()
        if not self.core.has_work():
            if self.next_i >= len(self.requests):
                return False
            self.clock = max(self.clock, self.arrivals[self.next_i])
            return True
        ran, had_outputs = self._step()
        if not ran and not had_outputs and self.core.has_work():
            self._wait_for_arrival()
        return True

    def _admit_arrivals(self) -> None:
        n, waiting = len(self.requests), self.scheduler.waiting
        while self.next_i < n and self.arrivals[self.next_i] <= self.clock and len(waiting) < self.lookahead:
            self._admit(self.next_i)
            self.next_i += 1

    def _admit(self, i: int) -> None:
        req = self.requests[i]
        if req.input_length > self.max_model_len:
            # The scheduler would reject it on length alone; skip synthesising its prompt.
            self.num_rejected += 1
            self._report(1)
            return
        rid = f"req-{req.index}"
        self.by_id[rid] = i
        params = SamplingParams(max_tokens=self.sim.max_tokens(req), ignore_eos=True, temperature=0.0)
        self.core.add_request(EngineCoreRequest(rid, self.synthesizer.prompt(req), params, self.arrivals[i]))

    def _sample_usage(self) -> None:
        """Called by the executor: after schedule() allocated this step's blocks, before any finish."""
        self.usage = 1.0 - self.pool.get_num_free_blocks() / (self.num_blocks - 1)
        self.peak_usage = max(self.peak_usage, self.usage)

    def _step(self) -> tuple[bool, bool]:
        """One engine step on the simulated clock: (whether it computed tokens, whether it had outputs)."""
        steps_before = self.executor.num_steps
        outputs = self.core.step().outputs
        ran = self.executor.num_steps != steps_before
        if ran:
            dt = self.executor.last_cost
            self.clock += dt
            self.usage_seconds += self.usage * dt
        done = sum(self._record(out) for out in outputs)
        if done:
            self._report(done)
        return ran, bool(outputs)

    def _record(self, out: EngineCoreOutput) -> bool:
        """Count one output; True when its request finished."""
        i = self.by_id[out.request_id]
        if out.new_token_ids:
            self.num_output_tokens += len(out.new_token_ids)
            if not self.has_first_token[i]:
                self.has_first_token[i] = True
                self.ttfts.append(self.clock - self.arrivals[i])
        if out.finish_reason is None:
            return False
        del self.by_id[out.request_id]
        if out.finish_reason == "error":
            self.num_rejected += 1
        else:
            self.num_finished += 1
            self.cached[i] = out.num_cached_tokens
        return True

    def _wait_for_arrival(self) -> None:
        """Nothing could be scheduled: only a later arrival can change that."""
        i, waiting = self.next_i, self.scheduler.waiting
        if i < len(self.requests) and self.arrivals[i] > self.clock and len(waiting) < self.lookahead:
            self.clock = self.arrivals[i]
            return
        raise RuntimeError(
            f"replay stalled at t={self.clock:.3f}s: {len(self.scheduler.running)} running, "
            f"{len(waiting)} waiting, {self.pool.get_num_free_blocks()} free blocks"
        )

    def _report(self, num_done: int) -> None:
        if self.report is not None:
            self.report(num_done)

    def _result(self, wall_time_s: float, keep_per_request: bool) -> SimResult:
        num_prompt = sum(r.input_length for r in self.requests)
        num_cached = sum(c for c in self.cached if c > 0)
        ceiling = sum(self.ceiling_hits)
        cache = self.config.cache
        return SimResult(
            num_requests=len(self.requests),
            num_finished=self.num_finished,
            num_rejected=self.num_rejected,
            num_prompt_tokens=num_prompt,
            num_cached_tokens=num_cached,
            hit_rate=num_cached / num_prompt if num_prompt else 0.0,
            ceiling_cached_tokens=ceiling,
            ceiling_hit_rate=ceiling / num_prompt if num_prompt else 0.0,
            num_output_tokens=self.num_output_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.executor.num_steps,
            num_prefill_tokens_computed=self.executor.num_prefill_tokens,
            num_decode_tokens_computed=self.executor.num_decode_tokens,
            num_blocks=self.num_blocks,
            kv_cache_tokens=(self.num_blocks - 1) * cache.block_size,
            block_size=cache.block_size,
            max_model_len=self.max_model_len,
            peak_kv_usage=self.peak_usage,
            mean_kv_usage=self.usage_seconds / self.clock if self.clock > 0 else 0.0,
            sim_time_s=self.clock,
            ttft_p50_s=percentile(self.ttfts, 50),
            ttft_p90_s=percentile(self.ttfts, 90),
            ttft_p99_s=percentile(self.ttfts, 99),
            wall_time_s=wall_time_s,
            free_blocks_at_end=self.pool.get_num_free_blocks(),
            hash_algo=cache.prefix_caching_hash_algo,
            prefix_caching=cache.enable_prefix_caching,
            per_request_cached_tokens=self.cached if keep_per_request else None,
        )
