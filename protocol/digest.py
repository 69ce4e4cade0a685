"""Digest of a request's block lists, for --check-block-tables."""

import hashlib
from array import array


def block_ids_digest(block_ids: list[list[int]]) -> bytes:
    """8 bytes over the block ids of every KV cache group, in order."""
    h = hashlib.blake2b(digest_size=8)
    for group in block_ids:
        h.update(len(group).to_bytes(4, "little"))
        h.update(array("i", group).tobytes())
    return h.digest()
