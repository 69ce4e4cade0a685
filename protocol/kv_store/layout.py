"""Where the disk tier keeps its blocks, and the file format of one block.

DIR/<fingerprint>/ holds one tier: the fingerprint names the model, dtype, block size and KV layout, so
blocks of another configuration are never read (they live in another folder). Each block is one file,
blocks/<first two hex digits>/<key in hex>.kv, written to a temporary name and renamed, so a file under its
final name is whole unless the disk corrupted it. A file carries a header (magic, its key, its fingerprint,
the payload length and a CRC-32 of the payload) that is checked on every read: a file that fails is a miss.
"""

import contextlib
import os
import struct
import zlib
from collections.abc import Iterator

MAGIC = b"KVB1"
_HEADER = struct.Struct("<4sHHQI")  # magic, key length, fingerprint length, payload length, crc32 of the payload
_SUFFIX, _TMP_SUFFIX = ".kv", ".tmp"


class BlockFileError(ValueError):
    """A block file that is missing, truncated, corrupt, or of another key or fingerprint."""


class DiskLayout:
    def __init__(self, root: str, fingerprint: str, rank: int = 0, tensor_parallel_size: int = 1) -> None:
        """Under tensor parallelism each rank keeps its shard of every block (its KV heads) in DIR/<fingerprint>/
        rank<r>/, and its files carry the rank in their fingerprint."""
        tier = os.path.join(os.path.abspath(root), fingerprint)
        if tensor_parallel_size == 1:
            self.fingerprint, self.dir = fingerprint, tier
        else:
            self.fingerprint, self.dir = f"{fingerprint}/rank{rank}", os.path.join(tier, f"rank{rank}")
        self.blocks_dir = os.path.join(self.dir, "blocks")
        self.index_path = os.path.join(self.dir, "index.sqlite")

    def block_path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self.blocks_dir, name[:2], name + _SUFFIX)

    def write_block(self, key: bytes, payload: memoryview) -> int:
        """Write one block (temporary file, then rename); its size on disk. Raises OSError (a full disk)."""
        path = self.block_path(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fp = self.fingerprint.encode()
        header = _HEADER.pack(MAGIC, len(key), len(fp), payload.nbytes, zlib.crc32(payload)) + key + fp
        tmp = f"{path}.{os.getpid()}{_TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            _remove(tmp)
            raise
        return len(header) + payload.nbytes

    def read_block(self, key: bytes, expected_bytes: int) -> memoryview:
        """The payload of key's file, checked against its header; BlockFileError if anything is off."""
        path = self.block_path(key)
        try:
            with open(path, "rb") as f:
                buffer = bytearray(os.fstat(f.fileno()).st_size)  # writable: the worker copies out of it in place
                data = memoryview(buffer)[: f.readinto(buffer)]
        except OSError as e:
            raise BlockFileError(f"cannot read {path}: {e.strerror or e}") from None
        fp = self.fingerprint.encode()
        if len(data) < _HEADER.size:
            raise BlockFileError(f"{path} is truncated ({len(data)} bytes)")
        magic, key_len, fp_len, payload_len, crc = _HEADER.unpack_from(data)
        start = _HEADER.size + key_len + fp_len
        if magic != MAGIC or data[_HEADER.size : _HEADER.size + key_len] != key or data[start - fp_len : start] != fp:
            raise BlockFileError(f"{path} is not this tier's block of that key")
        payload = data[start:]
        if payload_len != expected_bytes or payload.nbytes != payload_len:
            raise BlockFileError(f"{path} holds {payload.nbytes} bytes of {payload_len}, expected {expected_bytes}")
        if zlib.crc32(payload) != crc:
            raise BlockFileError(f"{path} fails its checksum")
        return payload

    def remove_block(self, key: bytes) -> None:
        _remove(self.block_path(key))

    def scan(self) -> Iterator[tuple[bytes, int, float]]:
        """(key, size, modification time) of every block file; removes temporary files of dead writers."""
        if not os.path.isdir(self.blocks_dir):
            return
        for sub in os.scandir(self.blocks_dir):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if entry.name.endswith(_TMP_SUFFIX):
                    _remove_if_writer_gone(entry.path)
                    continue
                key = _key_of(entry.name)
                if key is not None:
                    with contextlib.suppress(OSError):  # removed meanwhile (another engine evicted it)
                        st = entry.stat()
                        yield key, st.st_size, st.st_mtime


def _key_of(name: str) -> bytes | None:
    if not name.endswith(_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[: -len(_SUFFIX)])
    except ValueError:
        return None


def _remove_if_writer_gone(path: str) -> None:
    """A temporary file whose writer (its pid is in the name) is gone was left by a crash."""
    try:
        pid = int(path[: -len(_TMP_SUFFIX)].rsplit(".", 1)[1])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        _remove(path)
    except PermissionError:  # alive, another user's
        pass


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
