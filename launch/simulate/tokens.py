"""Token synthesis: each trace hash id becomes 512 pseudo-random token ids, a SHAKE-128 stream keyed
by (seed, id); the last block of a prompt is truncated to the remainder.

Equal ids give equal tokens and different ids give unrelated ones, so the engine's own chained block
hashes find exactly the sharing the trace records, at any block size that divides 512. Token ids are
31-bit (int32 >= 0), so even tiny block sizes do not collide by chance. A replay makes a prompt when
its request enters the engine and drops it when the request finishes; only a bounded LRU of
per-id blocks is kept.
"""

import hashlib
import sys
from array import array
from collections import OrderedDict

from launch.simulate.trace import TRACE_BLOCK_TOKENS, TraceRequest

VOCAB_SIZE = 1 << 31  # synthetic token ids are non-negative int32


class TokenSynthesizer:
    """hash id -> 512 token ids, deterministic in (seed, id); a bounded LRU of packed blocks."""

    def __init__(self, seed: int = 0, cache_size: int = 1 << 15) -> None:
        self.seed = seed
        self.cache_size = cache_size
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._msb = 3 if sys.byteorder == "little" else 0  # byte holding the sign bit of an int32
        self._clear_sign = bytes(b & 0x7F for b in range(256))

    def block_bytes(self, hash_id: int) -> bytes:
        """512 packed non-negative int32 token ids (native byte order)."""
        cached = self._cache.get(hash_id)
        if cached is not None:
            self._cache.move_to_end(hash_id)
            return cached
        key = b"kvengine-sim" + self.seed.to_bytes(8, "little", signed=True)
        key += hash_id.to_bytes(16, "little", signed=True)
        raw = bytearray(hashlib.shake_128(key).digest(4 * TRACE_BLOCK_TOKENS))
        raw[self._msb :: 4] = raw[self._msb :: 4].translate(self._clear_sign)
        data = bytes(raw)
        self._cache[hash_id] = data
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return data

    def block_tokens(self, hash_id: int) -> list[int]:
        return array("i", self.block_bytes(hash_id)).tolist()

    def prompt(self, request: TraceRequest) -> list[int]:
        packed = b"".join(self.block_bytes(h) for h in request.hash_ids)
        return array("i", packed[: 4 * request.input_length]).tolist()
