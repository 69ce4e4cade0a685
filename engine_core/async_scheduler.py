"""AsyncScheduler: the engine core schedules step N+1 before step N's output is back, as vLLM's does.

A request whose step N samples a token holds one output placeholder, counted in num_computed_tokens
but not yet in its tokens, so step N+1 can feed it (the workers know the token). A request that stops
on a token is therefore computed one step more, and that output is dropped; one whose step in flight
reaches its length limit is not scheduled again. A request preempted with a step in flight still gets
that step's token (it is stale: appended, never recomputed). Placeholders are made and turned into
tokens here; the base Scheduler reads them where it decides and at preemption, and without this
class they stay 0.
"""

from engine_core.request import Request, RequestStatus
from engine_core.scheduler import Scheduler

_RUNNING = RequestStatus.RUNNING  # an enum member read from its class costs a lookup each time


class AsyncScheduler(Scheduler):
    async_scheduling = True

    def _update_after_schedule(self, scheduled: list[Request], num_scheduled_tokens: dict[str, int]) -> None:
        super()._update_after_schedule(scheduled, num_scheduled_tokens)
        for request in scheduled:  # a step that reaches the request's last known token samples one more
            if request.num_computed_tokens >= len(request.all_token_ids) + request.num_output_placeholders:
                request.num_output_placeholders += 1

    def _update_request_with_output(
        self, request: Request, token_ids: list[int]
    ) -> tuple[list[int], RequestStatus | None]:
        running = request.status == _RUNNING  # not a stale token of a request preempted since
        new_token_ids, status = Scheduler._update_request_with_output(self, request, token_ids)  # not super(): hot
        if running:  # the placeholder is a token now: its block may be full
            request.num_output_placeholders -= 1  # one step's answer (several tokens where it verified drafts)
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens - request.num_output_placeholders)
        return new_token_ids, status
