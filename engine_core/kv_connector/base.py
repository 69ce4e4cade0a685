"""KVConnectorScheduler: the engine core's side of a second KV tier, as vLLM's KV connector splits it.

The scheduler asks, for a waiting request, how many tokens beyond its memory prefix hit the tier holds
(get_num_new_matched_tokens); it allocates blocks for them and tells the connector (update_state_after_alloc);
the request then waits in the WAITING_FOR_REMOTE_KVS state, holding its blocks, until the workers report the
load finished (update_connector_output), and is scheduled like any other with those tokens computed. Blocks
registered in the memory prefix cache are announced to the connector (on_blocks_cached), which decides what to
save. Each step's transfers travel to the workers in SchedulerOutput.kv_connector_metadata
(build_connector_meta); the workers' side is worker/kv_connector/.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from protocol import KVCacheEvent
from protocol.kv_transfer import KVConnectorMetadata, KVConnectorOutput, KVTierStats

if TYPE_CHECKING:
    from engine_core.kv_cache.block import KVCacheBlock
    from engine_core.request import Request


class KVConnectorScheduler(ABC):
    @abstractmethod
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        """Tokens after the first num_computed_tokens (the memory hit, whole blocks) that the tier can load.
        Never the request's last token: at least one is always computed."""

    @abstractmethod
    def update_state_after_alloc(self, request: "Request", blocks: Sequence[Sequence["KVCacheBlock"]],
                                 num_external_tokens: int) -> None:
        """Blocks (per KV cache group, all the request's) were allocated for the num_external_tokens that follow
        the memory hit: load them."""

    @abstractmethod
    def update_connector_output(self, output: KVConnectorOutput) -> list[tuple[str, int]]:
        """The workers' report; the requests whose loads finished, each with the tokens that loaded (leading;
        fewer than asked when a block was missing or corrupt)."""

    @abstractmethod
    def on_blocks_cached(self, request: "Request", blocks: Sequence["KVCacheBlock"], first: int, last: int,
                         group_id: int) -> None:
        """The request's blocks[first:last] were registered in the memory prefix cache (null blocks skipped)."""

    @abstractmethod
    def begin_schedule(self) -> None:
        """A schedule() starts: blocks cached before it are computed, and can be saved by this step."""

    @abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """This step's transfers; None when there are none and none are in flight."""

    @abstractmethod
    def has_pending(self) -> bool:
        """Transfers not yet sent or not yet reported: the engine keeps stepping until they are."""

    @abstractmethod
    def take_events(self) -> list[KVCacheEvent]:
        """KV events of the tier (blocks stored in it and removed from it) since the last call."""

    @abstractmethod
    def stats(self) -> KVTierStats:
        """The tier's totals since start-up."""

    @abstractmethod
    def shutdown(self) -> None:
        """The engine stops: release what the tier holds open (its index)."""
