"""TierLoads: the scheduler's requests that wait for blocks from the second tier (WAITING_FOR_REMOTE_KVS).

Such a request holds its blocks (the memory hit, and fresh ones the workers load into) but is in neither the
waiting queue nor the running batch, so no step touches its blocks while they load; the loaded blocks are
registered in the memory prefix cache only once the load is reported. It then goes back to the head of the
waiting queue with those tokens computed and is admitted like any other. One aborted while loading keeps its
blocks until the workers report the load (they are still writing them), then is freed.
"""

from typing import TYPE_CHECKING

from engine_core.kv_connector.base import KVConnectorScheduler
from engine_core.request import Request, RequestStatus
from protocol.kv_transfer import KVConnectorOutput

if TYPE_CHECKING:
    from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
    from engine_core.request_queue import FCFSRequestQueue, PriorityRequestQueue


class TierLoads:
    def __init__(self, connector: KVConnectorScheduler, manager: "KVCacheManager",
                 waiting: "FCFSRequestQueue | PriorityRequestQueue")  -> None:
        self.connector, self.manager, self.waiting = connector, manager, waiting
        self.requests: dict[str, Request] = {}  # loading
        manager.block_pool.on_blocks_cached = connector.on_blocks_cached

    def find_computed(self, request: Request, has_scheduled_reqs: bool) -> tuple["KVCacheBlocks | None", int] | None:
        """The head of the waiting queue's memory hit (none for one back from a load: it holds its blocks and
        tokens), or None if it went to load the tokens the tier holds after that hit."""
        if self.manager.holds_blocks(request.request_id):
            return None, request.num_computed_tokens
        hits, num_hit_tokens = self.manager.get_computed_blocks(request)
        num_external = self.connector.get_num_new_matched_tokens(request, num_hit_tokens)
        if num_external and self._start(request, hits, num_hit_tokens, num_external, has_scheduled_reqs):
            return None
        return hits, num_hit_tokens

    def _start(self, request: Request, hits: "KVCacheBlocks", num_hit_tokens: int, num_external: int,
               has_scheduled_reqs: bool) -> bool:
        """Allocate blocks for the hit and the tier's tokens, and load; False (nothing changed) if they do not fit."""
        blocks = self.manager.allocate_slots(request, num_external, num_hit_tokens, hits, full_sequence_must_fit=True,
                                             has_scheduled_reqs=has_scheduled_reqs, delay_cache_blocks=True)
        if blocks is None:
            return False
        self.waiting.pop()  # the scheduler asks for the head of the queue
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_hit_tokens
        self.requests[request.request_id] = request
        self.connector.update_state_after_alloc(request, self.manager.get_blocks(request.request_id).blocks,
                                                num_external)
        return True

    def update(self, output: KVConnectorOutput) -> list[Request]:
        """Apply the workers' report; the requests aborted while loading, now to be freed."""
        aborted = []
        for req_id, num_loaded_tokens in self.connector.update_connector_output(output):
            request = self.requests.pop(req_id)
            if request.is_finished:
                aborted.append(request)
                continue
            request.num_computed_tokens += num_loaded_tokens
            request.status = RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
            if request.num_computed_tokens:
                # Sliding-window blocks the load skipped hold nothing: freed (null) before the rest is registered.
                self.manager.coordinator.remove_skipped_blocks(request.request_id, request.num_computed_tokens)
                self.manager.cache_blocks(request, request.num_computed_tokens)
            else:  # nothing loaded and no memory hit: it starts afresh
                self.manager.free(request)
            self.waiting.prepend(request)
        return aborted

    def abort(self, request: Request) -> bool:
        """True if the request is loading: it keeps its blocks until the load is reported."""
        if request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return False
        request.status = RequestStatus.FINISHED_ABORTED
        return True
