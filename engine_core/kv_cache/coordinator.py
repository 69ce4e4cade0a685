"""Coordinators spread each ledger call over the KV cache groups, all sharing one BlockPool."""

from typing import TYPE_CHECKING

from engine_core.kv_cache.block import BlockHash, KVCacheBlock
from engine_core.kv_cache.block_pool import BlockPool
from engine_core.kv_cache.single_type_manager import MANAGER_CLASS, get_manager_for_kv_cache_spec
from protocol.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheSpec

if TYPE_CHECKING:
    from engine_core.request import Request


class KVCacheCoordinator:
    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_num_batched_tokens: int,
        enable_caching: bool,
        enable_kv_cache_events: bool,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, enable_kv_cache_events,
                                    [group.kv_cache_spec for group in kv_cache_config.kv_cache_groups])
        self.single_type_managers = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self.block_pool, i, max_num_batched_tokens)
            for i, group in enumerate(kv_cache_config.kv_cache_groups)
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[list[KVCacheBlock], ...],
        apply_admission_cap: bool = False,
    ) -> int:
        return sum(
            manager.get_num_blocks_to_allocate(request_id, num_tokens, hits, apply_admission_cap)
            for manager, hits in zip(self.single_type_managers, new_computed_blocks, strict=True)
        )

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: tuple[list[KVCacheBlock], ...]) -> None:
        for manager, hits in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks(request_id, hits)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        return tuple(manager.allocate_new_blocks(request_id, num_tokens) for manager in self.single_type_managers)

    def cache_blocks(self, request: "Request", num_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(manager.get_blocks(request_id) for manager in self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: list[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Per group, the hit blocks; and the hit length in tokens."""
        raise NotImplementedError


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    def __init__(self, kv_cache_config: KVCacheConfig, max_num_batched_tokens: int, enable_kv_cache_events: bool):
        super().__init__(kv_cache_config, max_num_batched_tokens, False, enable_kv_cache_events)

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        return tuple([] for _ in self.single_type_managers), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV cache group: the single manager answers directly."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_num_batched_tokens: int, enable_kv_cache_events: bool):
        super().__init__(kv_cache_config, max_num_batched_tokens, True, enable_kv_cache_events)
        self.kv_cache_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        manager = self.single_type_managers[0]
        hits = manager.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, [0], self.block_pool, self.kv_cache_spec
        )
        return hits, len(hits[0]) * manager.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups: groups with equal specs are searched together, full attention first."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_num_batched_tokens: int, enable_kv_cache_events: bool):
        super().__init__(kv_cache_config, max_num_batched_tokens, True, enable_kv_cache_events)
        self.spec_groups = self.verify_and_split_kv_cache_groups(kv_cache_config)
        self.block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size

    @staticmethod
    def verify_and_split_kv_cache_groups(kv_cache_config: KVCacheConfig) -> list[tuple[KVCacheSpec, list[int]]]:
        by_spec: dict[KVCacheSpec, list[int]] = {}
        for i, group in enumerate(kv_cache_config.kv_cache_groups):
            by_spec.setdefault(group.kv_cache_spec, []).append(i)
        if len(by_spec) < 2:
            raise ValueError(
                "HybridKVCacheCoordinator needs at least two distinct KV cache specs; "
                "a single spec is served by UnitaryKVCacheCoordinator"
            )
        block_sizes = {spec.block_size for spec in by_spec}
        if len(block_sizes) != 1:
            raise ValueError(f"hybrid KV cache groups must share one block size, got {sorted(block_sizes)}")
        # Full attention's hit is a plain prefix: searching it first gives the others a tight bound.
        return sorted(by_spec.items(), key=lambda item: not isinstance(item[0], FullAttentionSpec))

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        """Shrink the hit length until every spec group hits that far (a fixed point)."""
        num_groups = len(self.single_type_managers)
        hit_length = max_cache_hit_length
        while True:
            hits_per_group: list[list[KVCacheBlock]] = [[] for _ in range(num_groups)]
            shrunk = False
            for spec, group_ids in self.spec_groups:
                hits = MANAGER_CLASS[type(spec)].find_longest_cache_hit(
                    block_hashes, hit_length, group_ids, self.block_pool, spec
                )
                length = len(hits[0]) * self.block_size
                if length < hit_length:
                    hit_length, shrunk = length, True
                for group_id, group_hits in zip(group_ids, hits, strict=True):
                    hits_per_group[group_id] = group_hits
            if not shrunk or hit_length == 0:
                break
        if hit_length == 0:
            return tuple([] for _ in range(num_groups)), 0
        num_blocks = hit_length // self.block_size
        return tuple(group_hits[:num_blocks] for group_hits in hits_per_group), hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_num_batched_tokens: int,
    enable_caching: bool,
    enable_kv_cache_events: bool = False,
) -> KVCacheCoordinator:
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_config, max_num_batched_tokens, enable_kv_cache_events)
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, max_num_batched_tokens, enable_kv_cache_events)
    return HybridKVCacheCoordinator(kv_cache_config, max_num_batched_tokens, enable_kv_cache_events)
