"""RankMerge: the disk tier under tensor parallelism. Each rank saves and loads its own shard of every block (its
KV heads, in a folder of its own), and only rank 0 answers the engine core; so in each step that carries transfers
(every rank runs it, in the same order) the ranks gather what each finished. A transfer counts once every rank
finished it: a load with the fewest blocks any rank loaded, a save only if every rank wrote it; a block one rank
dropped is reported removed at once (the tier no longer has it whole), once."""

import msgspec
import torch.distributed as dist

from protocol.kv_transfer import KVConnectorOutput

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(KVConnectorOutput).decode


class RankMerge:
    def __init__(self, size: int) -> None:
        self.size = size
        self._loads: dict[str, list[int]] = {}  # request id -> blocks each rank that finished it loaded
        self._saves: dict[bytes, list[bool]] = {}  # key -> each rank that finished it: written or not
        self._removed: dict[bytes, int] = {}  # key -> ranks that dropped it, until all have (reported at the first)

    def gather(self, done: KVConnectorOutput) -> KVConnectorOutput | None:
        """Every rank's finished transfers (a collective: every rank calls it in the same steps); what is finished
        on all ranks, or None."""
        frames: list[bytes | None] = [None] * self.size
        dist.all_gather_object(frames, _encode(done))
        return self.merge([_decode(frame) for frame in frames if frame is not None])

    def merge(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput | None:
        merged = KVConnectorOutput()
        for out in outputs:
            for req_id, num_blocks in zip(out.finished_loads, out.num_loaded_blocks, strict=True):
                self._loads.setdefault(req_id, []).append(num_blocks)
            for key in out.saved_keys:
                self._saves.setdefault(key, []).append(True)
            for key in out.failed_save_keys:
                self._saves.setdefault(key, []).append(False)
            for key in out.removed_keys:
                self._count_removal(key, merged)
            merged.load_bytes += out.load_bytes
            merged.save_bytes += out.save_bytes
            merged.num_failed_blocks += out.num_failed_blocks
        for req_id in [r for r, counts in self._loads.items() if len(counts) == self.size]:
            merged.finished_loads.append(req_id)
            merged.num_loaded_blocks.append(min(self._loads.pop(req_id)))
        for key in [k for k, oks in self._saves.items() if len(oks) == self.size]:
            (merged.saved_keys if all(self._saves.pop(key)) else merged.failed_save_keys).append(key)
            self._removed.pop(key, None)  # written again: a later drop is news
        return merged if merged != KVConnectorOutput() else None

    def _count_removal(self, key: bytes, merged: KVConnectorOutput) -> None:
        count = self._removed.get(key, 0) + 1
        if count == 1:
            merged.removed_keys.append(key)
        if count == self.size:
            self._removed.pop(key, None)
        else:
            self._removed[key] = count
