"""The free block queue: a doubly linked list threaded through the blocks themselves.

Order is eviction order: blocks are taken from the front. Uncached frees go to the front (nothing
to lose), cached frees to the back (least recently used first). Removal from the middle is O(1),
which a prefix-cache hit on a free block needs.
"""

from itertools import pairwise

from engine_core.kv_cache.block import KVCacheBlock


def _linked(link: KVCacheBlock | None) -> KVCacheBlock:
    """A link of a block in the queue (or of a sentinel): the sentinels keep it from being None."""
    if link is None:
        raise RuntimeError("the free queue is broken: a link inside it is None")
    return link


class FreeKVCacheBlockQueue:
    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels keep every link operation branch-free.
        self.fake_head = KVCacheBlock(block_id=-1)
        self.fake_tail = KVCacheBlock(block_id=-1)
        chain = [self.fake_head, *blocks, self.fake_tail]
        for prev, nxt in pairwise(chain):
            prev.next_free_block = nxt
            nxt.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = _linked(self.fake_head.next_free_block)
        if block is self.fake_tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks: only {self.num_free_blocks} are free")
        if n == 0:
            return []
        out = []
        block = _linked(self.fake_head.next_free_block)
        for _ in range(n):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            # n <= num_free_blocks: the walk ends at the tail sentinel at the latest, never at None.
            block = nxt  # type: ignore[assignment]
        self.fake_head.next_free_block = block
        block.prev_free_block = self.fake_head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the back, in the order given."""
        self._insert_after(_linked(self.fake_tail.prev_free_block), blocks)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the front, in the order given (blocks[0] is taken first)."""
        self._insert_after(self.fake_head, blocks)

    def _insert_after(self, prev: KVCacheBlock, blocks: list[KVCacheBlock]) -> None:
        if not blocks:
            return
        last = _linked(prev.next_free_block)
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = last
        last.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front to back; for tests and debugging."""
        out = []
        block = _linked(self.fake_head.next_free_block)
        while block is not self.fake_tail:
            out.append(block)
            block = _linked(block.next_free_block)
        return out
