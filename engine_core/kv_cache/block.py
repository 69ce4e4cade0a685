"""One KV block's metadata. The KV data itself lives in the workers."""

from dataclasses import dataclass

BlockHash = bytes
# A block hash followed by 4 bytes of KV cache group id: one block can be cached per group.
BlockHashWithGroupId = bytes


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return block_hash + group_id.to_bytes(4, "big")


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return key[:-4]


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big")


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set only while the block is full and registered in the pool's hash map.
    _block_hash: BlockHashWithGroupId | None = None
    # Links of the free queue; only FreeKVCacheBlockQueue touches them.
    prev_free_block: "KVCacheBlock | None" = None
    next_free_block: "KVCacheBlock | None" = None
    # Block 0: a placeholder for table entries that hold no data. Never cached, never freed.
    is_null: bool = False

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        return self._block_hash

    @block_hash.setter
    def block_hash(self, key: BlockHashWithGroupId) -> None:
        assert self._block_hash is None, f"block {self.block_id} already has a hash"
        self._block_hash = key

    def reset_hash(self) -> None:
        self._block_hash = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self._block_hash is not None})"
