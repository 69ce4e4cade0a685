"""A request as the engine core tracks it: tokens, progress, status and block hashes."""

import enum
from typing import TYPE_CHECKING

from protocol import SamplingParams
from protocol.messages import FinishReason

if TYPE_CHECKING:
    from engine_core.kv_cache.hashing import RequestBlockHasher


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # holds its blocks while the second tier loads them
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


FINISH_REASON: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        priority: int = 0,
        block_hasher: "RequestBlockHasher | None" = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params or SamplingParams()
        self.stop_token_ids = frozenset(self.sampling_params.stop_token_ids)  # checked for every sampled token
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Async scheduling: tokens of scheduled steps whose output has not come back yet (counted in
        # num_computed_tokens, not in all_token_ids); at preemption they become stale: delivered, not recomputed.
        self.num_output_placeholders = 0
        self.num_stale_output_tokens = 0
        self.spec_token_ids: list[int] = []  # n-gram drafts of the step in flight (engine_core/spec_decode/)
        self.admitted_step = 0  # the step that last moved it from waiting to running
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1 until admitted
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        hasher = self._block_hasher
        # Most decode steps fill no block: the hasher is called only once one is full.
        if hasher is not None and len(self.all_token_ids) >= (len(self.block_hashes) + 1) * hasher.block_size:
            self.block_hashes.extend(hasher(self))

    def __lt__(self, other: "Request") -> bool:
        """Order of the priority policy: lower priority value first, then earlier arrival."""
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )
