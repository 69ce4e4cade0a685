"""The data-parallel replay: a trace through N real EngineCores, each with its SimExecutor, behind the real
router (launch/data_parallel/routing.py), all on one simulated clock.

Each engine runs its own steps: a step that starts at time t on engine e costs dt by the cost model, and
its outputs and KV events reach the router at t + dt, when e may start its next step. Requests are routed
when they arrive, with what the router knows then (the KV events and finishes delivered so far). The
router hashes each prompt itself, as `kvengine serve --data-parallel-size` does; the engines' own
events feed its index. `--kv-cache-tokens` is the total over the engines: each gets an equal share,
so figures for different N compare at the same total KV capacity. Each engine is fed lazily as in the
single-engine replay (its waiting queue holds at most max_num_seqs requests; the rest wait, already
routed, at the router).
"""

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

from engine_core.core import EngineCore
from launch.commands.percentiles import percentile
from launch.data_parallel.routing import Router, RouterPolicy
from launch.simulate.ceiling import count_prefix_hits
from launch.simulate.executor import SimExecutor
from launch.simulate.replay import SimConfig, check_settings, pool_size
from launch.simulate.tokens import TokenSynthesizer
from launch.simulate.trace import TraceRequest
from protocol import EngineCoreOutput, EngineCoreRequest, KVCacheEvent, SamplingParams
from protocol.config import EngineConfig, with_settings

# The ledger queues KV events only when an endpoint is configured; in a replay nothing is bound there.
SIM_KV_EVENTS_ENDPOINT = "inproc://kvengine-simulate"


@dataclass
class EngineFigures:
    num_requests: int = 0  # routed to this engine
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


@dataclass
class DPResult:
    num_engines: int
    router_policy: str
    num_requests: int
    num_finished: int
    num_rejected: int
    num_prompt_tokens: int
    num_cached_tokens: int
    hit_rate: float
    ceiling_hit_rate: float  # one infinite cache shared by all (no routing can beat it)
    kv_cache_tokens: int  # usable, over all engines
    kv_cache_tokens_per_engine: int
    sim_time_s: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    wall_time_s: float
    num_too_long: int  # rejected before routing: longer than max_model_len
    engines: list[EngineFigures]
    pools_empty_at_end: bool

    def checks(self) -> list[str]:
        problems = []
        if self.num_finished + self.num_rejected != self.num_requests:
            problems.append(f"only {self.num_finished + self.num_rejected} of {self.num_requests} requests finished")
        if not self.pools_empty_at_end:
            problems.append("an engine's pool ends with blocks in use")
        if sum(e.num_requests for e in self.engines) + self.num_too_long != self.num_requests:
            problems.append("routed requests do not add up")
        return problems

    def to_dict(self) -> dict:
        return asdict(self)


class SimEngine:
    """One engine core of the replay, and what it owes the router."""

    def __init__(self, index: int, config: EngineConfig, sim: SimConfig, num_blocks: int, max_model_len: int) -> None:
        self.index = index
        self.executor = SimExecutor(config.cache.block_size, num_blocks, max_model_len, sim.cost_model,
                                    sim.check_executor)
        self.core = EngineCore(config, self.executor)
        self.pending: deque[EngineCoreRequest] = deque()  # routed here, not yet in the engine's queue
        self.free_at = 0.0  # when the running step ends (its outputs and events reach the router)
        self.result: list[EngineCoreOutput] | None = None  # the running step's outputs
        self.events: list[KVCacheEvent] = []  # and its KV events
        self.stalled = False  # nothing could be scheduled: waits for a new request
        self.figures = EngineFigures()

    def has_work(self) -> bool:
        return bool(self.pending) or self.core.has_work()


class DPReplay:
    def __init__(
        self,
        requests: Sequence[TraceRequest],
        config: EngineConfig,
        sim: SimConfig,
        num_engines: int,
        policy: RouterPolicy,
        synthesizer: TokenSynthesizer | None = None,
    ) -> None:
        self.wall_start = time.perf_counter()
        self.requests = list(requests)
        check_settings(config, sim)
        bs = config.cache.block_size
        self.ceiling = count_prefix_hits(self.requests, bs)
        per_engine = replace(sim, kv_cache_tokens=None if sim.kv_cache_tokens is None
                             else max(sim.kv_cache_tokens // num_engines, bs))
        num_blocks, self.max_model_len = pool_size(config, per_engine, self.requests, self.ceiling)
        self.config = with_settings(config, num_gpu_blocks_override=num_blocks, max_model_len=self.max_model_len,
                                    kv_events_endpoint=SIM_KV_EVENTS_ENDPOINT, data_parallel_size=num_engines,
                                    router_policy=policy)
        self.num_blocks = num_blocks
        self.sim = sim
        self.engines = [SimEngine(i, self.config, sim, num_blocks, self.max_model_len) for i in range(num_engines)]
        self.router = Router(num_engines, policy, bs, config.cache.prefix_caching_hash_algo)
        self.synthesizer = synthesizer or TokenSynthesizer(sim.seed)
        scale = 0.0 if sim.as_fast_as_possible else sim.time_scale / 1000.0
        self.arrivals = [r.timestamp * scale for r in self.requests]
        self.lookahead = self.config.scheduler.max_num_seqs
        self.clock = 0.0
        self.next_i = 0
        self.by_id: dict[str, int] = {}  # request id -> trace position, while in an engine
        self.first_token = [math.nan] * len(self.requests)
        self.num_finished = self.num_rejected = self.num_too_long = 0

    def run(self, progress: Callable[[int], object] | None = None) -> DPResult:
        """progress: called with the number of requests just done."""
        self.progress = progress
        while self._turn():
            pass
        return self._result()

    def _turn(self) -> bool:
        """Advance the clock to the next event and handle everything due then; False once the trace is done."""
        t = min(self.arrivals[self.next_i] if self.next_i < len(self.requests) else math.inf,
                *(e.free_at if e.result is not None or (e.has_work() and not e.stalled) else math.inf
                  for e in self.engines))
        if t == math.inf:
            if any(e.has_work() for e in self.engines):
                stuck = [e.index for e in self.engines if e.has_work()]
                raise RuntimeError(f"replay stalled at t={self.clock:.3f}s: engines {stuck} cannot schedule")
            return False
        self.clock = max(self.clock, t)
        for engine in self.engines:
            if engine.result is not None and engine.free_at <= self.clock:
                self._deliver(engine)
        while self.next_i < len(self.requests) and self.arrivals[self.next_i] <= self.clock:
            self._route(self.next_i)
            self.next_i += 1
        for engine in self.engines:
            self._feed(engine)
            if engine.result is None and engine.free_at <= self.clock and engine.core.has_work():
                self._step(engine)
        return True

    def _route(self, i: int) -> None:
        req = self.requests[i]
        if req.input_length > self.max_model_len:  # rejected on length alone, as in the single-engine replay
            self.num_rejected += 1
            self.num_too_long += 1
            self._report(1)
            return
        prompt = self.synthesizer.prompt(req)
        engine = self.engines[self.router.route(prompt)]
        params = SamplingParams(max_tokens=self.sim.max_tokens(req), ignore_eos=True, temperature=0.0)
        engine.pending.append(EngineCoreRequest(f"req-{req.index}", prompt, params, self.arrivals[i]))
        engine.stalled = False
        engine.figures.num_requests += 1
        engine.figures.num_prompt_tokens += req.input_length
        self.by_id[f"req-{req.index}"] = i

    def _feed(self, engine: SimEngine) -> None:
        waiting = engine.core.scheduler.waiting
        while engine.pending and len(waiting) < self.lookahead:
            engine.core.add_request(engine.pending.popleft())

    def _step(self, engine: SimEngine) -> None:
        executor = engine.executor
        steps_before = executor.num_steps
        outputs = engine.core.step().outputs
        ran = executor.num_steps != steps_before
        if not ran and not outputs:
            engine.stalled = True
            return
        engine.free_at = self.clock + (executor.last_cost if ran else 0.0)
        engine.result = outputs
        engine.events = engine.core.take_kv_events()  # the router learns of them when the step ends

    def _deliver(self, engine: SimEngine) -> None:
        outputs, engine.result = engine.result or [], None
        events, engine.events = engine.events, []
        self.router.on_events(engine.index, events)
        done = 0
        for out in outputs:
            i = self.by_id[out.request_id]
            if out.new_token_ids and math.isnan(self.first_token[i]):
                self.first_token[i] = engine.free_at
            if out.finish_reason is None:
                continue
            del self.by_id[out.request_id]
            self.router.finished(engine.index)
            done += 1
            if out.finish_reason == "error":
                self.num_rejected += 1
            else:
                self.num_finished += 1
                engine.figures.num_cached_tokens += out.num_cached_tokens
        if done:
            self._report(done)

    def _report(self, n: int) -> None:
        if self.progress is not None:
            self.progress(n)

    def _result(self) -> DPResult:
        ttfts = [t - a for t, a in zip(self.first_token, self.arrivals, strict=True) if not math.isnan(t)]
        for engine in self.engines:
            engine.figures.num_preemptions = engine.core.scheduler.num_preemptions
            engine.figures.num_steps = engine.executor.num_steps
            engine.executor.state.clear()
        num_prompt = sum(r.input_length for r in self.requests)
        num_cached = sum(e.figures.num_cached_tokens for e in self.engines)
        usable = (self.num_blocks - 1) * self.config.cache.block_size
        pool_free = [e.core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() for e in self.engines]
        return DPResult(
            num_engines=len(self.engines),
            router_policy=self.router.policy,
            num_requests=len(self.requests),
            num_finished=self.num_finished,
            num_rejected=self.num_rejected,
            num_prompt_tokens=num_prompt,
            num_cached_tokens=num_cached,
            hit_rate=num_cached / num_prompt if num_prompt else 0.0,
            ceiling_hit_rate=sum(self.ceiling) / num_prompt if num_prompt else 0.0,
            kv_cache_tokens=usable * len(self.engines),
            kv_cache_tokens_per_engine=usable,
            sim_time_s=self.clock,
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p90_s=percentile(ttfts, 90),
            ttft_p99_s=percentile(ttfts, 99),
            wall_time_s=time.perf_counter() - self.wall_start,
            num_too_long=self.num_too_long,
            engines=[e.figures for e in self.engines],
            pools_empty_at_end=all(free == self.num_blocks - 1 for free in pool_free),
        )


def dp_compare(requests: Sequence[TraceRequest], config: EngineConfig, sim: SimConfig, num_engines: int,
               policies: Sequence[RouterPolicy]) -> list[DPResult]:
    """One replay per policy, at the same total KV capacity and the same synthesized tokens."""
    synthesizer = TokenSynthesizer(sim.seed)
    return [DPReplay(requests, config, sim, num_engines, p, synthesizer).run() for p in policies]
