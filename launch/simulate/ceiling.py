"""The infinite-cache ceiling, counted directly over hash ids: what a cache that never evicts would hit.

A replay with a pool too large to evict must find exactly these hits (`--check-ceiling`), and no
replay may find more.
"""

from collections.abc import Sequence

from launch.simulate.trace import TRACE_BLOCK_TOKENS, TraceRequest, check_block_size


class PrefixTrie:
    """Hash-id chains seen so far; per chain, the most tokens of its last 512-block any request had
    (512 for a full block, the remainder for a partial last one)."""

    def __init__(self) -> None:
        self.children: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> node
        self.seen: list[int] = [TRACE_BLOCK_TOKENS]  # per node; node 0 is the empty chain

    def hit_tokens(self, req: TraceRequest) -> int:
        """Whole blocks while an earlier chain had at least as many of their tokens, plus the overlap of
        the first block that earlier requests had only partially."""
        hit, node = 0, 0
        for j, h in enumerate(req.hash_ids):
            child = self.children.get((node, h))
            if child is None:
                break
            block_len = min(TRACE_BLOCK_TOKENS, req.input_length - j * TRACE_BLOCK_TOKENS)
            have = self.seen[child]
            hit += min(have, block_len)
            if have < block_len:
                break
            node = child
        return hit

    def insert(self, req: TraceRequest) -> None:
        node = 0
        for j, h in enumerate(req.hash_ids):
            block_len = min(TRACE_BLOCK_TOKENS, req.input_length - j * TRACE_BLOCK_TOKENS)
            child = self.children.get((node, h))
            if child is None:
                child = self.children[(node, h)] = len(self.seen)
                self.seen.append(block_len)
            elif self.seen[child] < block_len:
                self.seen[child] = block_len
            node = child


def count_prefix_hits(requests: Sequence[TraceRequest], block_size: int) -> list[int]:
    """Per request (in the order given), the prefix-cache hit in tokens with an infinite cache.

    Capped at input_length - 1 (a hit never covers the last prompt token) and rounded down to
    block_size: the engine caches whole blocks of block_size tokens only.
    """
    check_block_size(block_size)
    trie = PrefixTrie()
    hits = []
    for req in requests:
        hits.append(min(trie.hit_tokens(req), req.input_length - 1) // block_size * block_size)
        trie.insert(req)
    return hits
