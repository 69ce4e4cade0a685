"""EngineCore: start-up sizing, then schedule -> execute -> update, one step at a time (or, with async
scheduling, step N+1 scheduled and sent before step N's output is applied)."""

import logging
import time
from collections import deque

from engine_core.async_scheduler import AsyncScheduler
from engine_core.executor.abstract import Executor
from engine_core.kv_cache.planning import KVCacheSizingError, capacity_line, get_kv_cache_config
from engine_core.kv_connector.base import KVConnectorScheduler
from engine_core.kv_connector.factory import make_kv_connector
from engine_core.request import RequestStatus
from engine_core.scheduler import Scheduler
from engine_core.structured_output import StructuredOutputManager
from protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    KVCacheConfig,
    KVCacheEvent,
    KVSchedulerOutput,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    WorkerKVReport,
)
from protocol.config import EngineConfig
from protocol.kv_transfer import KVTierStats
from protocol.sizes import format_bytes

logger = logging.getLogger(__name__)
GRAMMAR_WAIT = 0.005  # seconds an idle step waits for a held request's grammar (new client messages are read between)


def plan_kv_cache(config: EngineConfig, reports: list[WorkerKVReport]) -> tuple[int, KVCacheConfig]:
    """Resolve max_model_len and size the cache: the minimum block count across ranks."""
    specs = reports[0].kv_cache_specs
    for report in reports[1:]:
        if report.kv_cache_specs != specs:
            raise KVCacheSizingError(f"rank {report.rank} reports other KV cache specs than rank 0")
    max_positions = min(r.max_position_embeddings for r in reports)
    max_model_len = config.model.max_model_len or max_positions
    if max_model_len > max_positions:
        raise KVCacheSizingError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings ({max_positions})"
        )
    budget = config.scheduler.max_num_batched_tokens
    if max_model_len > budget and not config.scheduler.enable_chunked_prefill:
        raise KVCacheSizingError(
            f"--max-model-len {max_model_len} is larger than --max-num-batched-tokens {budget} with chunked "
            "prefill off: a sequence longer than one step's budget could never be scheduled; raise "
            "--max-num-batched-tokens, lower --max-model-len or drop --no-enable-chunked-prefill"
        )
    override = config.cache.num_gpu_blocks_override
    for r in reports:
        logger.info("Rank %d can give the KV cache %s (%s)%s", r.rank, format_bytes(r.available_kv_bytes),
                    r.memory_detail, f" on host {r.host}" if r.host else "")
    kv_cache_config = get_kv_cache_config(
        specs,
        [r.available_kv_bytes for r in reports],
        max_model_len,
        budget,
        override,
    )
    logger.info(
        "KV cache: %d blocks of %d tokens in %d group(s) (minimum across %d rank(s)%s)",
        kv_cache_config.num_blocks,
        config.cache.block_size,
        len(kv_cache_config.kv_cache_groups),
        len(reports),
        ", overridden by --num-gpu-blocks-override" if override else "",
    )
    logger.info(capacity_line(kv_cache_config, max_model_len, budget))
    return max_model_len, kv_cache_config


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor,
                 kv_connector: KVConnectorScheduler | None = None) -> None:
        """kv_connector: a second KV tier's engine-core side; default: the one the settings ask for (or none)."""
        self.executor = executor
        reports = executor.determine_available_memory()
        self.max_model_len, self.kv_cache_config = plan_kv_cache(config, reports)
        self.config = config
        executor.initialize_kv_cache(self.kv_cache_config)
        scheduler_cls = AsyncScheduler if config.scheduler.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(self.config, self.kv_cache_config, self.max_model_len,
                                       reports[0].eos_token_ids, reports[0].vocab_size,
                                       kv_connector or make_kv_connector(config, self.kv_cache_config,
                                                                         reports[0].kv_fingerprint))
        self._pending: list[EngineCoreOutput] = []  # rejections and aborts, sent with the next step
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: deque[SchedulerOutput] = deque()  # async scheduling: sent, output not applied yet
        self.structured = StructuredOutputManager(config.model.model, reports[0].vocab_size, reports[0].eos_token_ids)
        self._grammar_due: tuple[int, list[str]] | None = None  # async: the newest step's rows, sent once it is next

    def add_request(self, request: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; if it can never run, its error output (also sent with the next step's outputs). A
        request with structured outputs waits for its grammar first (engine_core/structured_output/)."""
        if self.structured.hold(request):
            return None
        rejected = self.scheduler.add_request(request)
        if rejected is not None:
            self._pending.append(rejected)
        return rejected

    def abort_requests(self, request_ids: list[str]) -> None:
        self._pending.extend(self.structured.abort(request_ids))
        self._pending.extend(self.scheduler.abort_requests(request_ids))

    def has_work(self) -> bool:
        return (self.scheduler.has_requests() or bool(self._pending) or bool(self._in_flight)
                or bool(self.structured.waiting))

    def step(self) -> EngineCoreOutputs:
        outputs, self._pending = self._pending, []
        outputs += self._admit_structured()
        self.structured.advance(outputs)  # the matchers of requests ended meanwhile (aborted, refused) are dropped
        if self.async_scheduling:
            outputs += self._step_async()
        elif self.scheduler.has_requests():
            so = self.scheduler.schedule()
            if _tells_workers(so):
                outputs += self._update(so, self._execute(so))
        elif not outputs and self.structured.waiting:
            self.structured.wait(GRAMMAR_WAIT)
        return EngineCoreOutputs(outputs, time.time())

    def _admit_structured(self) -> list[EngineCoreOutput]:
        """Queue the held requests whose grammar is ready; the error outputs of those that cannot run."""
        ready, ended = self.structured.take_ready()
        for request in ready:
            rejected = self.scheduler.add_request(request)
            if rejected is not None:
                ended.append(rejected)
        return ended

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step; with constrained requests sampling in it, their bitmask follows while the forward runs."""
        ids = self.structured.sampling_ids(so, self.scheduler.requests)
        if not ids:
            return self.executor.execute_model(so)
        self.executor.submit(so, grammar_follows=True)
        self.executor.submit_grammar(self.structured.grammar_output(so.step, ids))
        return self.executor.collect(so)

    def _update(self, so: SchedulerOutput, output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply a step's output; constrained requests' matchers take their tokens, and those whose grammar is
        complete (or failed) end here."""
        outputs = self.scheduler.update_from_output(so, output)
        for out in self.structured.advance(outputs):
            status = RequestStatus.FINISHED_STOPPED if out.finish_reason == "stop" else RequestStatus.FINISHED_ERROR
            self.scheduler.finish_requests([out.request_id], status)
        return outputs

    def _step_async(self) -> list[EngineCoreOutput]:
        """Schedule and send the next step, then apply the oldest one once two are in flight (or nothing
        more is to come): the workers have step N+1 queued while the engine core applies step N and routes
        its outputs. Decisions follow vLLM's batch queue of two, so they do not depend on timing; as there,
        a step with nothing in it takes a place in the queue (it is never sent)."""
        in_flight = self._in_flight
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            if _tells_workers(so):
                ids = self.structured.sampling_ids(so, self.scheduler.requests)
                if ids:
                    self.executor.submit(so, grammar_follows=True)
                    self._grammar_due = (so.step, ids)
                else:
                    self.executor.submit(so)
            in_flight.append(so)
            if len(in_flight) < 2 and (so.total_num_scheduled_tokens or self.scheduler.has_requests()):
                self._send_grammar()  # the only step in flight: every earlier one is applied
                return []
        elif not in_flight:
            return []
        so = in_flight.popleft()
        if not in_flight:
            self._send_grammar()
        outputs = self._update(so, self.executor.collect(so)) if _tells_workers(so) else []
        self._send_grammar()
        return outputs

    def _send_grammar(self) -> None:
        """Async: the bitmask of the newest step in flight, from matchers that have taken every earlier step's
        tokens (vLLM's order: computed while the step's forward runs, before it samples)."""
        if self._grammar_due is not None:
            step, ids = self._grammar_due
            self._grammar_due = None
            self.executor.submit_grammar(self.structured.grammar_output(step, ids))

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Ledger events since the last call, then the second tier's (empty unless enable_kv_cache_events)."""
        events = self.scheduler.kv_cache_manager.take_events()
        if self.scheduler.kv_connector is not None:
            events += self.scheduler.kv_connector.take_events()
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (an AllBlocksCleared event); refused (False, logged) while blocks are in use."""
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.make_stats()
        stats.num_waiting_reqs += len(self.structured.waiting)  # held for their grammar
        return stats

    def get_tier_stats(self) -> list[KVTierStats]:
        """The second KV tier's totals (none without one): for the metrics, in this process, off the wire."""
        connector = self.scheduler.kv_connector
        return [] if connector is None else [connector.stats()]

    def info(self) -> EngineInfo:
        config = self.kv_cache_config
        return EngineInfo(self.max_model_len, self.config.cache.block_size, config.num_blocks - 1)

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
        if self.scheduler.kv_connector is not None:
            self.scheduler.kv_connector.shutdown()


def _tells_workers(so: SchedulerOutput) -> bool:
    """Tokens to compute, requests the workers must drop, or second-tier transfers: a step worth sending."""
    return bool(so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids
                or isinstance(so, KVSchedulerOutput))
