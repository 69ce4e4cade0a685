"""The scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill or decode phases. Each step every request gets as many of its uncomputed
tokens as the budget allows, so long prompts are prefilled in chunks beside decoding requests.
With long_prefill_token_threshold a request gets at most that many tokens a step, so one long
prompt does not take the whole budget (unless it is the only request); with enable_chunked_prefill
off a waiting request whose tokens do not fit the remaining budget is not split, and admissions stop
until a later step.
When a running request cannot get a block, the newest running request (or, with the priority
policy, the least important) is preempted: its blocks are freed and it is recomputed later.
Async scheduling's output placeholders (async_scheduler.py) are counted here too: without it they stay 0.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar

import msgspec

from engine_core.kv_cache.hashing import get_hash_fn, get_request_block_hasher
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_connector.base import KVConnectorScheduler
from engine_core.kv_connector.loading import TierLoads
from engine_core.prompt_logprobs import attach_prompt_logprobs
from engine_core.request import FINISH_REASON, Request, RequestStatus
from engine_core.request_checks import request_error
from engine_core.request_queue import make_request_queue
from engine_core.sampled_tokens import check_stop, sampled_rows
from engine_core.scheduler_stats import make_scheduler_stats
from engine_core.spec_decode.drafting import SpecDecoding
from protocol import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreRequest,
    KVCacheConfig,
    KVModelRunnerOutput,
    KVSchedulerOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    block_ids_digest,
)
from protocol.config import EngineConfig
from protocol.speculative import parse_speculative_config


@dataclass(slots=True)
class _ScheduleState:
    """What one schedule() call has decided so far: its running pass hands it to its waiting pass."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    req_to_new_blocks: dict[str, KVCacheBlocks] = field(default_factory=dict)
    scheduled_running_reqs: list[Request] = field(default_factory=list)
    scheduled_new_reqs: list[Request] = field(default_factory=list)
    preempted_reqs: list[Request] = field(default_factory=list)


class Scheduler:
    async_scheduling: ClassVar[bool] = False  # AsyncScheduler's hooks keep output placeholders

    def __init__(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        kv_connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = config.scheduler
        self.max_model_len = max_model_len
        self.kv_cache_config = kv_cache_config
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.kv_cache_manager = KVCacheManager(
            kv_cache_config,
            max_model_len=max_model_len,
            enable_caching=config.cache.enable_prefix_caching,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
            watermark=config.scheduler.watermark,
            enable_kv_cache_events=config.enable_kv_cache_events,
        )
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        self.block_hasher = (
            get_request_block_hasher(self.block_size, get_hash_fn(config.cache.prefix_caching_hash_algo))
            if config.cache.enable_prefix_caching
            else None
        )
        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(config.scheduler.scheduling_policy)
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last step, for the workers
        self.step = 0
        self.num_preemptions = 0  # totals since start-up, for stats
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_usable_blocks = kv_cache_config.num_blocks - 1
        self.kv_connector = kv_connector  # a second KV tier (engine_core/kv_connector/), or None
        self.tier_loads = None if kv_connector is None else TierLoads(kv_connector, self.kv_cache_manager, self.waiting)
        spec = config.scheduler.speculative_config  # n-gram drafts (engine_core/spec_decode/), or None
        self.spec = None if spec is None else SpecDecoding(parse_speculative_config(spec))
        if config.scheduler.async_scheduling != self.async_scheduling:  # EngineCore picks the class by it
            raise ValueError(f"{type(self).__name__} cannot run with async_scheduling={self.async_scheduling}")

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request, or return its error output if it can never run (the caller logs it: a server
        limits such warnings per client)."""
        error = request_error(self, req)
        if error is not None:
            return EngineCoreOutput(req.request_id, [], finish_reason="error", error=error)
        request = Request(req.request_id, req.prompt_token_ids, req.sampling_params, req.arrival_time, req.cache_salt,
                          req.priority, self.block_hasher)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        return [EngineCoreOutput(r.request_id, [], "abort", max(r.num_cached_tokens, 0))
                for r in self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)]

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """End unfinished requests with status (a client's abort, a structured output's end): those it ended."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:  # finished: aborted while loading, freed once loaded
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif self.tier_loads is None or not self.tier_loads.abort(request):  # a loading one is freed once loaded
                self.waiting.remove(request)
            if request.status != RequestStatus.FINISHED_ABORTED:
                self._finish(request, status)
            finished.append(request)
        return finished

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ids the workers have not been told about yet."""
        connector = self.kv_connector
        return bool(self.requests) or bool(self.finished_req_ids) or (connector is not None and connector.has_pending())

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's tokens. Nothing scheduled is a valid answer."""
        state = _ScheduleState(self.config.max_num_batched_tokens)
        if self.kv_connector is not None:
            self.kv_connector.begin_schedule()
        threshold = self._long_prefill_threshold()
        self._schedule_running(state, threshold)
        if not state.preempted_reqs:  # new admissions only when nobody had to make room this step
            self._schedule_waiting(state, threshold)
        return self._make_output(state)

    def _schedule_running(self, state: _ScheduleState, threshold: int) -> None:
        """Running requests in order, each as many tokens as it has uncomputed and the budget allows."""
        running = self.running  # changed in place by preemption
        allocate_slots = self.kv_cache_manager.allocate_slots
        i = 0
        while i < len(running) and state.token_budget > 0:
            request = running[i]
            placeholders = request.num_output_placeholders
            if placeholders and self._waits_for_answer(request):
                i += 1
                continue
            num_new_tokens = len(request.all_token_ids) + placeholders - request.num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, state.token_budget)
            if num_new_tokens <= 0:
                i += 1
                continue
            num_drafts = 0 if self.spec is None else len(
                self.spec.draft(request, num_new_tokens, state.token_budget, self._length_limit(request)))
            blocks = allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_drafts)
            if blocks is None:
                blocks, i = self._preempt_until_allocated(request, num_new_tokens, num_drafts, i, state)
                if blocks is None:
                    break  # it preempted itself: as in vLLM, no running request after it gets this step
            num_new_tokens += num_drafts  # the drafts are computed in the lookahead slots this step
            state.scheduled_running_reqs.append(request)
            state.num_scheduled_tokens[request.request_id] = num_new_tokens
            state.req_to_new_blocks[request.request_id] = blocks
            state.token_budget -= num_new_tokens
            i += 1

    def _waits_for_answer(self, request: Request) -> bool:
        """Async: the step in flight samples the request's last token, or its next drafts start after that token."""
        return (request.num_computed_tokens + 1 >= self._length_limit(request)
                or (self.spec is not None and self.spec.may_draft(request)))

    def _preempt_until_allocated(
        self, request: Request, num_new_tokens: int, num_drafts: int, i: int, state: _ScheduleState
    ) -> tuple[KVCacheBlocks | None, int]:
        """Preempt until running[i] gets its slots; None if it had to preempt itself. Also its index afterwards."""
        blocks = None
        while blocks is None:
            victim = self._pick_victim()
            if self.running.index(victim) < i:  # priority policy may pick one already passed
                i -= 1
            if victim in state.scheduled_running_reqs:
                state.scheduled_running_reqs.remove(victim)
                state.token_budget += state.num_scheduled_tokens.pop(victim.request_id)
                del state.req_to_new_blocks[victim.request_id]
            self._preempt(victim)
            state.preempted_reqs.append(victim)
            if victim is request:
                break
            blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens, num_lookahead_tokens=num_drafts)
        return blocks, i

    def _schedule_waiting(self, state: _ScheduleState, threshold: int) -> None:
        """Admit waiting requests in queue order while the budget, max_num_seqs and the pool allow."""
        manager, waiting = self.kv_cache_manager, self.waiting
        while len(waiting) and state.token_budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = waiting.peek()
            if (found := self._find_computed(request)) is None:
                continue  # it went to load from a second tier first
            hits, num_hit_tokens = found
            num_new_tokens = request.num_tokens - num_hit_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if not self.config.enable_chunked_prefill and num_new_tokens > state.token_budget:
                break  # not split: it stays at the head of the queue until a step has room for all of it
            num_new_tokens = min(num_new_tokens, state.token_budget)
            blocks = manager.allocate_slots(
                request,
                num_new_tokens,
                0 if hits is None else num_hit_tokens,  # None: back from a load, its tokens computed already
                hits,
                full_sequence_must_fit=True,
                has_scheduled_reqs=bool(self.running),
            )
            if blocks is None:
                break  # first come first served: nobody overtakes the head of the queue
            waiting.pop()
            self.running.append(request)
            state.scheduled_new_reqs.append(request)
            request.status = RequestStatus.RUNNING
            request.admitted_step = self.step + 1  # an admission always sends a step
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            state.num_scheduled_tokens[request.request_id] = num_new_tokens
            state.token_budget -= num_new_tokens

    def _find_computed(self, request: Request) -> tuple[KVCacheBlocks | None, int] | None:
        """The memory prefix hit; None if the request went to load from a second tier instead (tier_loads)."""
        if self.tier_loads is None:
            return self.kv_cache_manager.get_computed_blocks(request)
        return self.tier_loads.find_computed(request, bool(self.running))

    def _long_prefill_threshold(self) -> int:
        """The threshold keeps a long prompt from starving the others of the budget: with no other request
        running or waiting, as in vLLM, there is nobody to starve and it is off for this step."""
        if len(self.running) + len(self.waiting) <= 1:
            return 0
        return self.config.long_prefill_token_threshold

    def _length_limit(self, request: Request) -> int:
        """Tokens at which the request is length-capped: max_tokens outputs or max_model_len."""
        return min(request.num_prompt_tokens + request.sampling_params.max_tokens, self.max_model_len)

    def _pick_victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_stale_output_tokens, request.num_output_placeholders = request.num_output_placeholders, 0
        request.spec_token_ids = []  # its drafts are dropped with its blocks
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _make_output(self, state: _ScheduleState) -> SchedulerOutput:
        manager = self.kv_cache_manager
        num_scheduled_tokens, preempted = state.num_scheduled_tokens, state.preempted_reqs
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                block_ids=manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in state.scheduled_new_reqs
        ]
        cached = self._make_cached_request_data(state)
        self._update_after_schedule([*state.scheduled_running_reqs, *state.scheduled_new_reqs], num_scheduled_tokens)
        digests = None
        if self.config.check_block_tables:
            digests = {rid: block_ids_digest(manager.get_block_ids(rid)) for rid in num_scheduled_tokens}
        total = sum(num_scheduled_tokens.values())
        finished: list[str] = []
        meta = None if self.kv_connector is None else self.kv_connector.build_connector_meta()
        if total or self.finished_req_ids or preempted or meta:  # workers must hear of these even with no tokens
            self.step += 1
            finished, self.finished_req_ids = sorted(self.finished_req_ids), set()
        so = SchedulerOutput(
            step=self.step,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
            preempted_req_ids=[r.request_id for r in preempted],
            block_table_digests=digests,
            scheduled_spec_decode_tokens={r.request_id: r.spec_token_ids
                                          for r in state.scheduled_running_reqs if r.spec_token_ids} or None,
        )
        return so if meta is None else KVSchedulerOutput(**msgspec.structs.asdict(so), kv_connector_metadata=meta)

    def _make_cached_request_data(self, state: _ScheduleState) -> CachedRequestData:
        """Running requests: the block ids appended this step (None if none) and the tokens computed before it."""
        req_ids: list[str] = []
        new_block_ids: list[list[list[int]] | None] = []
        num_computed: list[int] = []
        for r in state.scheduled_running_reqs:
            blocks = state.req_to_new_blocks[r.request_id].blocks
            req_ids.append(r.request_id)
            new_block_ids.append([[b.block_id for b in group] for group in blocks] if any(blocks) else None)
            num_computed.append(r.num_computed_tokens)
        return CachedRequestData(req_ids=req_ids, new_block_ids=new_block_ids, num_computed_tokens=num_computed)

    def _update_after_schedule(self, scheduled: list[Request], num_scheduled_tokens: dict[str, int]) -> None:
        """Tokens count as computed once scheduled."""
        for request in scheduled:
            request.num_computed_tokens += num_scheduled_tokens[request.request_id]

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish requests that are done, and say what each client gets."""
        requests, running_status, update_request = self.requests, RequestStatus.RUNNING, self._update_request_with_output
        outputs = []
        num_generated = 0
        num_finished = 0
        step = scheduler_output.step
        if self.tier_loads is not None and isinstance(model_runner_output, KVModelRunnerOutput):
            for aborted in self.tier_loads.update(model_runner_output.kv_connector_output):
                self._finish(aborted, aborted.status)
        for req_id, token_ids, token_logprobs in sampled_rows(scheduler_output, model_runner_output):
            request = requests.get(req_id)
            if request is None or not token_ids or request.admitted_step > step:
                continue  # finished or aborted while the step ran (its id maybe taken since), or nothing sampled
            running = request.status == running_status
            if not running:  # async: preempted while this step ran (stale), or an id taken since
                if not request.num_stale_output_tokens:
                    continue
                request.num_stale_output_tokens -= 1  # one step's answer, however many tokens
            if not request.output_token_ids:
                self.num_prompt_tokens += request.num_prompt_tokens
            if request.spec_token_ids and self.spec is not None:
                self.spec.on_output(request, len(token_ids))  # rejected drafts: num_computed_tokens rolls back
            new_token_ids, status = update_request(request, token_ids)
            num_generated += len(new_token_ids)
            reason = None
            if status is not None:
                if not running:
                    self.waiting.remove(request)
                self._finish(request, status)
                reason = FINISH_REASON[status]
                num_finished += 1
            outputs.append(EngineCoreOutput(req_id, new_token_ids, reason, request.num_cached_tokens, None,
                                            None if token_logprobs is None else [token_logprobs]))
        self.num_generation_tokens += num_generated
        attach_prompt_logprobs(outputs, model_runner_output)
        if num_finished:  # one pass, however many finished
            self.running[:] = [r for r in self.running if r.status == running_status]
        return outputs

    def _update_request_with_output(
        self, request: Request, token_ids: list[int]
    ) -> tuple[list[int], RequestStatus | None]:
        """The tokens up to the first that finishes the request (those after it dropped), appended in one call."""
        n, status = check_stop(request, token_ids, self.eos_token_ids, self.max_model_len)
        new_token_ids = token_ids if n == len(token_ids) else token_ids[:n]
        request.append_output_token_ids(new_token_ids)
        return new_token_ids, status

    def make_stats(self) -> SchedulerStats:
        return make_scheduler_stats(self)
