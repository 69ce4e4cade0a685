"""Data-parallel routing: which engine core gets a request.

`PrefixIndex` maps block hashes to the engines that hold them, fed by each engine's own KV event
batches (BlockStored / BlockRemoved / AllBlocksCleared, vLLM's wire format). `Router` hashes a
request's full prompt blocks the ledger's way (engine_core/kv_cache/hashing.py: chained, the cache
salt in the first block, the low 64 bits as in the events), keeps each engine's load (requests routed
to it and not finished: its running + waiting, plus those in transit) and picks an engine by policy:

  prefix       the engine holding the longest prefix of the request's blocks; least load where they tie
  round-robin  engines in turn
  least-load   the engine with the fewest requests

Per request the work is O(blocks of the request + engines). Only KV cache group 0 is indexed (for
a hybrid model, its first group stands for the others). Pure and torch-free: `kvengine serve
--data-parallel-size` and the DP simulation use it unchanged.
"""

from collections.abc import Sequence
from typing import Literal

from engine_core.kv_cache.hashing import get_hash_fn, hash_block_tokens
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, external_block_hash

RouterPolicy = Literal["prefix", "round-robin", "least-load"]
ROUTER_POLICIES: tuple[RouterPolicy, ...] = ("prefix", "round-robin", "least-load")


class PrefixIndex:
    """block hash -> engines holding it; per engine a count per hash (the ledger may store a hash twice)."""

    def __init__(self, num_engines: int) -> None:
        self.holders: dict[int, set[int]] = {}
        self.counts: list[dict[int, int]] = [{} for _ in range(num_engines)]

    def apply(self, engine: int, events: Sequence[KVCacheEvent]) -> None:
        """One engine's events, in the order it published them."""
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.clear(engine)
            elif event.group_idx:  # group 0 (or None: an engine without groups) only
                continue
            elif isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self._store(engine, _int_hash(h))
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self._remove(engine, _int_hash(h))

    def _store(self, engine: int, h: int) -> None:
        counts = self.counts[engine]
        n = counts.get(h, 0)
        counts[h] = n + 1
        if not n:
            self.holders.setdefault(h, set()).add(engine)

    def _remove(self, engine: int, h: int) -> None:
        counts = self.counts[engine]
        n = counts.get(h, 0)
        if n > 1:
            counts[h] = n - 1
        elif n == 1:
            del counts[h]
            self._drop_holder(engine, h)

    def _drop_holder(self, engine: int, h: int) -> None:
        engines = self.holders[h]
        engines.discard(engine)
        if not engines:
            del self.holders[h]

    def clear(self, engine: int) -> None:
        """Forget everything the engine holds (AllBlocksCleared, or the engine is gone)."""
        for h in self.counts[engine]:
            self._drop_holder(engine, h)
        self.counts[engine] = {}

    def matched_blocks(self, block_hashes: Sequence[int]) -> list[int]:
        """Per engine, how many leading blocks of the chain it holds."""
        matched = [0] * len(self.counts)
        alive: set[int] | None = None
        for i, h in enumerate(block_hashes):
            engines = self.holders.get(h)
            if not engines:
                break
            alive = set(engines) if alive is None else alive & engines
            if not alive:
                break
            for e in alive:
                matched[e] = i + 1
        return matched

    def num_blocks(self, engine: int) -> int:
        return len(self.counts[engine])


def _int_hash(h: int | bytes) -> int:
    """vLLM's schema allows raw digest bytes too; kvengine's engines send ints."""
    return h if isinstance(h, int) else external_block_hash(h)


class RequestHasher:
    """The external (64-bit) hashes of a prompt's full blocks, as the engines' ledgers compute them."""

    def __init__(self, block_size: int, hash_algo: str) -> None:
        self.block_size = block_size
        self.hash_fn = get_hash_fn(hash_algo)

    def __call__(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        bs, parent, out = self.block_size, None, []
        for i in range(len(token_ids) // bs):
            extra = (cache_salt,) if i == 0 and cache_salt else None  # as hashing.block_extra_keys
            parent = hash_block_tokens(self.hash_fn, parent, token_ids[i * bs : (i + 1) * bs], extra)
            out.append(external_block_hash(parent))
        return out


class Router:
    """Picks an engine per request and keeps the loads; engines marked dead are never picked."""

    def __init__(self, num_engines: int, policy: RouterPolicy, block_size: int, hash_algo: str) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; choose from {', '.join(ROUTER_POLICIES)}")
        self.policy = policy
        self.index = PrefixIndex(num_engines)
        self.hasher = RequestHasher(block_size, hash_algo)
        self.loads = [0] * num_engines
        self.alive = [True] * num_engines
        self.next_engine = 0  # round-robin position
        self.num_routed = [0] * num_engines

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The engine for a new request; its load counts the request until `finished`. ValueError if none lives."""
        live = [e for e, ok in enumerate(self.alive) if ok]
        if not live:
            raise ValueError("no engine core is running")
        if self.policy == "round-robin":
            engine = self._round_robin()
        elif self.policy == "least-load":
            engine = min(live, key=self.loads.__getitem__)
        else:
            blocks = self.index.matched_blocks(self.hasher(token_ids, cache_salt))
            engine = min(live, key=lambda e: (-blocks[e], self.loads[e]))
        self.loads[engine] += 1
        self.num_routed[engine] += 1
        return engine

    def _round_robin(self) -> int:
        n = len(self.alive)
        for k in range(n):
            engine = (self.next_engine + k) % n
            if self.alive[engine]:
                self.next_engine = (engine + 1) % n
                return engine
        raise AssertionError("route() checked that an engine lives")

    def finished(self, engine: int) -> None:
        """A request routed to engine finished (its final output went back)."""
        self.loads[engine] -= 1

    def on_events(self, engine: int, events: Sequence[KVCacheEvent]) -> None:
        if self.alive[engine]:
            self.index.apply(engine, events)

    def engine_dead(self, engine: int) -> None:
        """Never route to it again; its cached blocks are gone."""
        self.alive[engine] = False
        self.index.clear(engine)
        self.loads[engine] = 0
