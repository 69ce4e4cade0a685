"""The scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill or decode phases. Each step every request gets as many of its uncomputed
tokens as the budget allows, so long prompts are prefilled in chunks beside decoding requests.
With long_prefill_token_threshold a request gets at most that many tokens a step, so one long
prompt does not take the whole budget (unless it is the only request); with enable_chunked_prefill
off a waiting request whose tokens do not fit the remaining budget is not split, and admissions stop
until a later step.
When a running request cannot get a block, the newest running request (or, with the priority
policy, the least important) is preempted: its blocks are freed and it is recomputed later.

With async_scheduling the engine core schedules step N+1 before step N's output is back, as vLLM's
AsyncScheduler does: a request whose step N samples a token holds one output placeholder, counted in
num_computed_tokens but not yet in its tokens, so step N+1 can feed it (the workers know the token).
A request that stops on a token is therefore computed one step more, and that output is dropped; one
whose step in flight reaches its length limit is not scheduled again. A request preempted with a step
in flight still gets that step's token (it is stale: appended, never recomputed).
"""

from collections.abc import Iterable
from itertools import repeat

from engine_core.kv_cache.hashing import get_hash_fn, get_request_block_hasher
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.kv_cache.planning import blocks_per_request
from engine_core.request import FINISH_REASON, Request, RequestStatus
from engine_core.request_queue import make_request_queue
from protocol import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreRequest,
    KVCacheConfig,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
    block_ids_digest,
)
from protocol.config import EngineConfig


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        eos_token_ids: Iterable[int] = (),
        vocab_size: int | None = None,
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
        self.async_scheduling = config.scheduler.async_scheduling

    # ---- requests in and out ---------------------------------------------------------------

    def add_request(self, req: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request, or return its error output if it can never run (the caller logs it: a server
        limits such warnings per client)."""
        error = self._validate(req)
        if error is not None:
            return EngineCoreOutput(req.request_id, [], finish_reason="error", error=error)
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.arrival_time,
            req.cache_salt,
            req.priority,
            self.block_hasher,
        )
        self.requests[request.request_id] = request
        self.waiting.add(request)
        return None

    def _validate(self, req: EngineCoreRequest) -> str | None:
        if req.request_id in self.requests:
            return f"request id {req.request_id!r} is already in use"
        num_prompt = len(req.prompt_token_ids)
        if num_prompt == 0:
            return "the prompt is empty"
        if num_prompt > self.max_model_len:
            return f"the prompt has {num_prompt} tokens, more than max_model_len={self.max_model_len}"
        if self.vocab_size is not None and not (min(req.prompt_token_ids) >= 0 and max(req.prompt_token_ids) < self.vocab_size):
            return f"the prompt has token ids outside the vocabulary [0, {self.vocab_size})"
        full_len = min(num_prompt + req.sampling_params.max_tokens, self.max_model_len)
        needed = blocks_per_request(self.kv_cache_config.kv_cache_groups, full_len, self.config.max_num_batched_tokens)
        if needed > self.num_usable_blocks:
            return (
                f"the request needs {needed} KV blocks for {full_len} tokens, more than the whole cache "
                f"({self.num_usable_blocks} blocks); lower max_tokens or the prompt length"
            )
        return None

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(EngineCoreOutput(request_id, [], "abort", max(request.num_cached_tokens, 0)))
        return outputs

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ids the workers have not been told about yet."""
        return bool(self.requests) or bool(self.finished_req_ids)

    # ---- one step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's tokens. Nothing scheduled is a valid answer."""
        budget = self.config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        new_blocks: dict[str, KVCacheBlocks] = {}
        scheduled_running: list[Request] = []
        scheduled_new: list[Request] = []
        preempted: list[Request] = []

        running = self.running  # changed in place by preemption
        allocate_slots = self.kv_cache_manager.allocate_slots
        threshold = self._long_prefill_threshold()
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            placeholders = request.num_output_placeholders
            if placeholders and request.num_computed_tokens + 1 >= self._length_limit(request):
                i += 1  # async: the step in flight samples its last token
                continue
            num_new_tokens = len(request.all_token_ids) + placeholders - request.num_computed_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            num_new_tokens = min(num_new_tokens, budget)
            if num_new_tokens <= 0:
                i += 1
                continue
            blocks = allocate_slots(request, num_new_tokens)
            while blocks is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:  # priority policy may pick one already passed
                    i -= 1
                if victim in scheduled_running:
                    scheduled_running.remove(victim)
                    budget += num_scheduled_tokens.pop(victim.request_id)
                    del new_blocks[victim.request_id]
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
                blocks = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if blocks is None:
                break  # it preempted itself: as in vLLM, no running request after it gets this step
            scheduled_running.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            new_blocks[request.request_id] = blocks
            budget -= num_new_tokens
            i += 1

        # New admissions only when nobody had to make room this step.
        while not preempted and len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            hits, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_hit_tokens
            if 0 < threshold < num_new_tokens:
                num_new_tokens = threshold
            if not self.config.enable_chunked_prefill and num_new_tokens > budget:
                break  # not split: it stays at the head of the queue until a step has room for all of it
            num_new_tokens = min(num_new_tokens, budget)
            blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens,
                num_hit_tokens,
                hits,
                full_sequence_must_fit=True,
                has_scheduled_reqs=bool(self.running),
            )
            if blocks is None:
                break  # first come first served: nobody overtakes the head of the queue
            self.waiting.pop()
            self.running.append(request)
            scheduled_new.append(request)
            request.status = RequestStatus.RUNNING
            request.admitted_step = self.step + 1  # an admission always sends a step
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            num_scheduled_tokens[request.request_id] = num_new_tokens
            budget -= num_new_tokens

        return self._make_output(scheduled_new, scheduled_running, new_blocks, num_scheduled_tokens, preempted)

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
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def _make_output(
        self,
        scheduled_new: list[Request],
        scheduled_running: list[Request],
        new_blocks: dict[str, KVCacheBlocks],
        num_scheduled_tokens: dict[str, int],
        preempted: list[Request],
    ) -> SchedulerOutput:
        manager = self.kv_cache_manager
        new_reqs = [
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=list(r.output_token_ids),
                sampling_params=r.sampling_params,
                block_ids=manager.get_block_ids(r.request_id),
                num_computed_tokens=r.num_computed_tokens,
            )
            for r in scheduled_new
        ]
        req_ids: list[str] = []
        new_block_ids: list[list[list[int]] | None] = []
        num_computed: list[int] = []
        for r in scheduled_running:
            rid = r.request_id
            blocks = new_blocks[rid].blocks
            req_ids.append(rid)
            new_block_ids.append([[b.block_id for b in group] for group in blocks] if any(blocks) else None)
            num_computed.append(r.num_computed_tokens)
            r.num_computed_tokens += num_scheduled_tokens[rid]  # tokens count as computed once scheduled
        for r in scheduled_new:
            r.num_computed_tokens += num_scheduled_tokens[r.request_id]
        if self.async_scheduling:  # a step that reaches a request's last known token samples one more
            for r in (*scheduled_running, *scheduled_new):
                if r.num_computed_tokens >= len(r.all_token_ids) + r.num_output_placeholders:
                    r.num_output_placeholders += 1
        cached = CachedRequestData(req_ids=req_ids, new_block_ids=new_block_ids, num_computed_tokens=num_computed)
        digests = None
        if self.config.check_block_tables:
            digests = {rid: block_ids_digest(manager.get_block_ids(rid)) for rid in num_scheduled_tokens}
        total = sum(num_scheduled_tokens.values())
        finished: list[str] = []
        if total or self.finished_req_ids or preempted:  # workers must hear of these even in a step with no tokens
            self.step += 1
            finished, self.finished_req_ids = sorted(self.finished_req_ids), set()
        return SchedulerOutput(
            step=self.step,
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished,
            preempted_req_ids=[r.request_id for r in preempted],
            block_table_digests=digests,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish requests that are done, and say what each client gets."""
        requests, running_status, append_tokens = self.requests, RequestStatus.RUNNING, self._append_tokens
        outputs = []
        num_generated = 0
        num_finished = 0
        async_scheduling, step = self.async_scheduling, scheduler_output.step
        for req_id, token_ids, token_logprobs in _sampled_rows(scheduler_output, model_runner_output):
            request = requests.get(req_id)
            if request is None or not token_ids or request.admitted_step > step:
                continue  # finished or aborted while the step ran (its id maybe taken since), or nothing sampled
            running = request.status == running_status
            if not running:  # async: preempted while this step ran (stale), or an id taken since
                if not request.num_stale_output_tokens:
                    continue
                request.num_stale_output_tokens -= len(token_ids)
            if not request.output_token_ids:
                self.num_prompt_tokens += request.num_prompt_tokens
            new_token_ids, status = append_tokens(request, token_ids)
            num_generated += len(new_token_ids)
            if async_scheduling and running:  # the placeholder is a token now: its block may be full
                request.num_output_placeholders -= len(token_ids)
                self.kv_cache_manager.cache_blocks(
                    request, request.num_computed_tokens - request.num_output_placeholders)
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
        if num_finished:  # one pass, however many finished
            self.running[:] = [r for r in self.running if r.status == running_status]
        return outputs

    def _append_tokens(self, request: Request, token_ids: list[int]) -> tuple[list[int], RequestStatus | None]:
        """The tokens up to the first that finishes the request, appended in one call (one hashing pass)."""
        params = request.sampling_params
        stop_ids = request.stop_token_ids
        eos_ids = () if params.ignore_eos else self.eos_token_ids
        # The n-th token (from 1) reaches max_tokens or max_model_len when n >= limit.
        limit = min(params.max_tokens - len(request.output_token_ids), self.max_model_len - len(request.all_token_ids))
        status = None
        n = 0
        for token in token_ids:
            n += 1
            if token in stop_ids or token in eos_ids:
                status = RequestStatus.FINISHED_STOPPED
                break
            if n >= limit:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
                break
        if status is None:
            request.append_output_token_ids(token_ids)
            return token_ids, None
        new_token_ids = token_ids[:n]
        request.append_output_token_ids(new_token_ids)
        return new_token_ids, status

    def make_stats(self) -> SchedulerStats:
        """O(running requests): cheap enough for a snapshot several times a second on a large pool."""
        manager = self.kv_cache_manager
        pool = manager.block_pool
        prefix = manager.prefix_cache_stats
        # Only running requests hold blocks, and only a request's last block per group can be partial
        # (prefix hits are full blocks), so held blocks and stored tokens follow without a walk.
        held = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
        partial_fills = [
            r.num_computed_tokens % self.block_size
            for r in self.running
            for _ in range(manager.num_kv_cache_groups)
            if r.num_computed_tokens % self.block_size
        ]
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=manager.get_usage(),
            num_free_blocks=pool.get_num_free_blocks(),
            num_blocks_held=held,
            num_cached_free_blocks=pool.num_cached_free_blocks,
            num_tokens_stored=(held - len(partial_fills)) * self.block_size + sum(partial_fills),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            step=self.step,
        )


def _sampled_rows(
    scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
) -> Iterable[tuple[str, list[int] | None, TokenLogprobs | None]]:
    """Per scheduled request in schedule order: its sampled tokens and logprobs (None where the runner gave none)."""
    scheduled = scheduler_output.num_scheduled_tokens
    req_ids, sampled, logprobs = (
        model_runner_output.req_ids, model_runner_output.sampled_token_ids, model_runner_output.logprobs
    )
    columns_match = len(sampled) == len(req_ids) and (logprobs is None or len(logprobs) == len(req_ids))
    if columns_match and req_ids == list(scheduled):  # the usual answer: one row per request, in schedule order
        return zip(req_ids, sampled, logprobs or repeat(None), strict=False)
    sampled_of = dict(zip(req_ids, sampled, strict=False))
    logprobs_of = dict(zip(req_ids, logprobs or [], strict=False))
    return ((req_id, sampled_of.get(req_id), logprobs_of.get(req_id)) for req_id in scheduled)
