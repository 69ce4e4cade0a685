"""DiskConnectorScheduler: the engine core's side of the local disk tier (--kv-disk-path).

Write-through: every block registered in the memory prefix cache is saved, unless the tier has it already,
by the step after the one that computed it (its data is copied out before that step's forward, so a block
freed and reused meanwhile is still read whole). A block evicted from memory is therefore already on disk,
a clean stop loses nothing computed, and the other engine cores of the host find it at once. Lookups read
the shared index (protocol/kv_store/index.py) plus the saves still in flight: a worker runs its transfers
in order, so a load queued after a save reads what it wrote. With --preemption-mode recompute a resumed
request does not look in the tier (vLLM v1's recompute); with swap it does.

Every KV cache group's blocks are saved, each under its hash and group id. A hit of n blocks needs each
full-attention group's n blocks and, of each sliding-window group, only those in the window of the hit's end:
only these load (the loader frees the others before the blocks join the memory prefix cache). Under tensor
parallelism each rank keeps its shard in an index of its own, and a block is in the tier when every rank's is.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from engine_core.kv_cache.block import get_block_hash, get_group_id, make_block_hash_with_group_id
from engine_core.kv_cache.hashing import block_extra_keys
from engine_core.kv_connector.base import KVConnectorScheduler
from protocol import BlockRemoved, BlockStored, KVCacheEvent
from protocol.kv_cache_spec import num_skipped_blocks
from protocol.kv_events import MEDIUM_DISK, ExternalBlockHash, external_block_hash
from protocol.kv_store.index import BlockIndex
from protocol.kv_transfer import KVConnectorMetadata, KVConnectorOutput, KVLoad, KVTierStats

if TYPE_CHECKING:
    from engine_core.kv_cache.block import KVCacheBlock
    from engine_core.request import Request


@dataclass(slots=True)
class _Save:
    key: bytes
    block_id: int
    event: BlockStored | None  # what the KV event says once the block is on disk (None: events are off)


class DiskConnectorScheduler(KVConnectorScheduler):
    def __init__(self, indexes: list[BlockIndex], block_size: int, swap: bool, windows: Sequence[int | None] = (None,),
                 enable_kv_cache_events: bool = False) -> None:
        """indexes: one per tensor-parallel rank; windows: per KV cache group, its sliding window (None: full)."""
        self.indexes = indexes
        self.block_size = block_size
        self.swap = swap
        self.windows = list(windows)
        self.enable_kv_cache_events = enable_kv_cache_events
        self._cached: list[_Save] = []  # registered since the current schedule began
        self._ready: list[_Save] = []  # registered before it: computed, saved by this step
        self._saving: dict[bytes, _Save] = {}  # sent to the workers, not reported yet
        self._loads: list[KVLoad] = []  # this step's
        self._loading: dict[str, tuple[int, int]] = {}  # request id -> (blocks asked, tokens they bring), until reported
        self._events: list[KVCacheEvent] = []
        self.counters = KVTierStats(medium=MEDIUM_DISK)

    def _keys(self, request: "Request", start: int, end: int, group_id: int = 0) -> list[bytes]:
        return [make_block_hash_with_group_id(h, group_id) for h in request.block_hashes[start:end]]

    def _present(self, keys: list[bytes]) -> set[bytes]:
        """Keys on disk on every rank, or being written."""
        found = self.indexes[0].present(keys)
        for index in self.indexes[1:]:
            found &= index.present(keys)
        return found | (self._saving.keys() & set(keys))

    def _first_needed(self, start: int, end: int, window: int | None) -> int:
        """The first block a group needs loaded for a hit that ends at block end."""
        return start if window is None else max(start, num_skipped_blocks(end * self.block_size, window, self.block_size))

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        if request.sampling_params.prompt_logprobs is not None or (request.num_preemptions and not self.swap):
            return 0
        start = num_computed_tokens // self.block_size
        end = (request.num_tokens - 1) // self.block_size
        if end <= start:
            return 0
        keys = [self._keys(request, start, end, g) for g in range(len(self.windows))]
        found = self._present([k for group in keys for k in group])
        n = 0  # the full-attention groups' run
        full = [group for group, window in zip(keys, self.windows, strict=True) if window is None]
        while n < end - start and all(group[n] in found for group in full):
            n += 1
        for hit in range(n, 0, -1):  # the longest hit whose sliding windows are on disk too
            if all(k in found for group, window in zip(keys, self.windows, strict=True) if window is not None
                   for k in group[self._first_needed(start, start + hit, window) - start : hit]):
                return hit * self.block_size
        return 0

    def update_state_after_alloc(self, request: "Request", blocks: Sequence[Sequence["KVCacheBlock"]],
                                 num_external_tokens: int) -> None:
        start = request.num_computed_tokens // self.block_size
        end = start + num_external_tokens // self.block_size
        block_ids: list[int] = []
        keys: list[bytes] = []
        for g, window in enumerate(self.windows):
            first = self._first_needed(start, end, window)
            block_ids += [b.block_id for b in blocks[g][first:end]]
            keys += self._keys(request, first, end, g)
        self._loads.append(KVLoad(request.request_id, block_ids, keys))
        self._loading[request.request_id] = (len(keys), num_external_tokens)
        self.counters.hits += num_external_tokens

    def _loaded_tokens(self, asked: tuple[int, int], num_blocks: int) -> int:
        """What a load that stopped after num_blocks brings: with one full-attention group its leading blocks;
        with several groups, all or nothing (the groups' blocks are loaded one group after the other)."""
        num_keys, num_tokens = asked
        if num_blocks == num_keys:
            return num_tokens
        return num_blocks * self.block_size if self.windows == [None] else 0

    def update_connector_output(self, output: KVConnectorOutput) -> list[tuple[str, int]]:
        c = self.counters
        finished = []
        for req_id, num_blocks in zip(output.finished_loads, output.num_loaded_blocks, strict=True):
            asked = self._loading.pop(req_id, None)
            if asked is not None:
                finished.append((req_id, self._loaded_tokens(asked, num_blocks)))
                c.loaded_blocks += num_blocks
        for key in output.saved_keys:
            save = self._saving.pop(key, None)
            if save is not None and save.event is not None:
                self._events.append(save.event)
        for key in output.failed_save_keys:
            self._saving.pop(key, None)
        if output.removed_keys and self.enable_kv_cache_events:
            self._events += self._removed_events(output.removed_keys)
        c.saved_blocks += len(output.saved_keys)
        c.load_bytes += output.load_bytes
        c.save_bytes += output.save_bytes
        c.failed_blocks += output.num_failed_blocks
        c.removed_blocks += len(output.removed_keys)
        return finished

    @staticmethod
    def _removed_events(keys: list[bytes]) -> list[KVCacheEvent]:
        """One BlockRemoved per KV cache group (a key ends with its group id)."""
        by_group: dict[int, list[ExternalBlockHash]] = {}
        for key in keys:
            by_group.setdefault(get_group_id(key), []).append(external_block_hash(get_block_hash(key)))
        return [BlockRemoved(hashes, MEDIUM_DISK, group) for group, hashes in by_group.items()]

    def on_blocks_cached(self, request: "Request", blocks: Sequence["KVCacheBlock"], first: int, last: int,
                         group_id: int) -> None:
        for i in range(first, last):
            block = blocks[i]
            if not block.is_null:
                key = make_block_hash_with_group_id(request.block_hashes[i], group_id)
                self._cached.append(_Save(key, block.block_id, self._stored_event(request, i, group_id)))

    def _stored_event(self, request: "Request", i: int, group_id: int) -> BlockStored | None:
        if not self.enable_kv_cache_events:
            return None
        size = self.block_size
        return BlockStored(
            block_hashes=[external_block_hash(request.block_hashes[i])],
            parent_block_hash=external_block_hash(request.block_hashes[i - 1]) if i > 0 else None,
            token_ids=request.all_token_ids[i * size : (i + 1) * size],
            block_size=size,
            lora_id=None,
            medium=MEDIUM_DISK,
            lora_name=None,
            extra_keys=[block_extra_keys(request, i)],
            group_idx=group_id,
            kv_cache_spec_kind="full_attention" if self.windows[group_id] is None else "sliding_window",
            kv_cache_spec_sliding_window=self.windows[group_id],
        )

    def begin_schedule(self) -> None:
        self._ready += self._cached
        self._cached = []

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        saves, self._ready = self._ready, []
        if saves:  # those the tier has (or is writing) already are not written again
            on_disk, saving, kept = self._present([s.key for s in saves]), self._saving, []
            for save in saves:
                if save.key not in on_disk and save.key not in saving:
                    saving[save.key] = save
                    kept.append(save)
            saves = kept
        loads, self._loads = self._loads, []
        if not saves and not loads and not self._saving and not self._loading:
            return None
        return KVConnectorMetadata([s.block_id for s in saves], [s.key for s in saves], loads)

    def has_pending(self) -> bool:
        return bool(self._cached or self._ready or self._loads or self._saving or self._loading)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def stats(self) -> KVTierStats:
        return msgspec.structs.replace(self.counters)

    def shutdown(self) -> None:
        for index in self.indexes:
            index.close()
