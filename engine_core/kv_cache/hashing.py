"""Chained block hashes: hash(parent hash, extra keys, this block's token ids).

Inputs are packed bytes, never pickled objects, so the same prefix gives the same hash in every
process and every run. sha256 is the default because prefix-cache contents are tenant data;
xxhash (xxh3-128) is the fast, non-cryptographic option.
"""

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec
import xxhash

from engine_core.kv_cache.block import BlockHash

if TYPE_CHECKING:
    from engine_core.request import Request

HashFn = Callable[[bytes], bytes]

HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "xxhash": xxhash.xxh3_128_digest,
}


def get_hash_fn(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown prefix-cache hash {name!r}; choose from {sorted(HASH_FUNCTIONS)}") from None


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    packed = array("i", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


_encode_extra = msgspec.msgpack.Encoder().encode


def hash_block_tokens(
    hash_fn: HashFn, parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple | None = None
) -> BlockHash:
    """The first block has no parent; its chain starts from a fixed root digest."""
    if parent_hash is None:
        parent_hash = hash_fn(b"kvengine-root")
    extra = _encode_extra(extra_keys) if extra_keys else b""
    return hash_fn(parent_hash + len(extra).to_bytes(4, "little") + extra + _pack_tokens(token_ids))


def block_extra_keys(request: "Request", block_index: int) -> tuple | None:
    """What is hashed into a block besides its tokens: the cache salt, on the first block only."""
    return (request.cache_salt,) if block_index == 0 and request.cache_salt else None


class RequestBlockHasher:
    """Hashes the request's full blocks it has not hashed yet; block_size tells a caller when one is due."""

    def __init__(self, block_size: int, hash_fn: HashFn) -> None:
        self.block_size = block_size
        self.hash_fn = hash_fn

    def __call__(self, request: "Request") -> list[BlockHash]:
        block_size = self.block_size
        start = len(request.block_hashes)
        end = request.num_tokens // block_size
        parent = request.block_hashes[-1] if start else None
        new = []
        tokens = request.all_token_ids
        for i in range(start, end):
            block_tokens = tokens[i * block_size : (i + 1) * block_size]
            parent = hash_block_tokens(self.hash_fn, parent, block_tokens, block_extra_keys(request, i))
            new.append(parent)
        return new


def get_request_block_hasher(block_size: int, hash_fn: HashFn) -> RequestBlockHasher:
    return RequestBlockHasher(block_size, hash_fn)
