"""DiskConnectorWorker: the worker's side of the local disk tier (--kv-disk-path).

One I/O thread runs the transfers in the order the engine core sent them, so a load queued after a save reads
what the save wrote. A save's data is copied out of the KV cache before the step's forward (the block may be
reused by it) and written in the background; a load reads and checks each file in the background and writes
the blocks, which no step touches until the engine core hears the load finished. A missing, truncated or
corrupt file stops its request's load there (the rest is computed) with a warning, and leaves the tier; on a full
file system the tier drops its oldest blocks to make room, and a save that still fails is a warning (the block
stays in memory only). Whatever happens, every transfer is reported, so nothing waits forever.
At start the index is rebuilt from the files; at shutdown the queue is drained, so every save sent is on disk.
"""

import errno
import logging
import os
import queue
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable

import msgspec
import torch

from protocol import KVModelRunnerOutput, KVSchedulerOutput, ModelRunnerOutput, SchedulerOutput
from protocol.kv_store.index import BlockIndex
from protocol.kv_store.layout import BlockFileError, DiskLayout
from protocol.kv_transfer import KVConnectorMetadata, KVConnectorOutput, KVLoad
from worker.kv_connector.blocks import block_nbytes, cache_parts, copy_in, copy_out
from worker.kv_connector.ranks import RankMerge

log = logging.getLogger(__name__)
MAX_STAGED_BYTES = 256 << 20  # saves copied out and not yet written; past it a step waits for the disk
ROOM_BLOCKS = 64  # on a full file system, the most blocks dropped in eviction order before a save tries again
IDLE_WAIT = 0.005  # seconds a step with no tokens waits for a transfer to finish before answering


class DiskConnectorWorker:
    def __init__(self, layout: DiskLayout, budget: int | None, eviction: str, kv_caches: list,
                 ranks: RankMerge | None = None) -> None:
        """budget: the whole tier's (each of the ranks' shards gets its share); ranks: tensor parallelism's."""
        self.layout = layout
        self.parts = cache_parts(kv_caches)
        self.block_bytes = block_nbytes(self.parts)
        self.ranks = ranks
        os.makedirs(layout.dir, exist_ok=True)
        self.index = BlockIndex(layout.index_path, eviction)
        self.index.reconcile(layout.scan())
        share = 1 if ranks is None else ranks.size
        self.budget = (budget if budget is not None else int(
            0.9 * (shutil.disk_usage(layout.dir).free + share * self.index.total_bytes()))) // share
        self._done = KVConnectorOutput()
        for key in self.index.evict(self.budget):
            layout.remove_block(key)
        log.info("KV disk tier %s: %d blocks, %.1f of %.1f GiB", layout.dir, len(self.index),
                 self.index.total_bytes() / 2**30, self.budget / 2**30)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._pending = 0  # transfers queued and not finished
        self._staged = 0  # bytes of queued saves
        self._warned = False  # a failed save was logged; the next failures go to debug until one succeeds
        self._full_logged = False
        self._thread = threading.Thread(target=self._run, name="kv-disk-io", daemon=True)
        self._thread.start()

    def execute(self, so: SchedulerOutput, run: Callable[[SchedulerOutput], ModelRunnerOutput]) -> ModelRunnerOutput:
        """Start the step's transfers, run the step, and add the transfers that finished to its output (under
        tensor parallelism, those finished on every rank: worker/kv_connector/ranks.py)."""
        if isinstance(so, KVSchedulerOutput):
            self.start(so.kv_connector_metadata)
        output = run(so)
        if self.ranks is None:
            done = self.take_finished(wait=not so.total_num_scheduled_tokens)
        elif isinstance(so, KVSchedulerOutput):  # a step every rank runs: gather there
            done = self.ranks.gather(self.take_finished(wait=not so.total_num_scheduled_tokens) or KVConnectorOutput())
        else:
            return output
        if done is None:
            return output
        return KVModelRunnerOutput(**msgspec.structs.asdict(output), kv_connector_output=done)

    def start(self, meta: KVConnectorMetadata) -> None:
        for block_id, key in zip(meta.save_block_ids, meta.save_keys, strict=True):
            data = copy_out(self.parts, block_id)
            with self._cond:
                while self._staged > MAX_STAGED_BYTES:
                    self._cond.wait()
                self._staged += data.numel()
                self._pending += 1
            self._queue.put((key, data))
        for load in meta.loads:
            with self._cond:
                self._pending += 1
            self._queue.put(load)

    def take_finished(self, wait: bool = False) -> KVConnectorOutput | None:
        """What finished since the last call (None: nothing). wait: give a pending transfer IDLE_WAIT to finish."""
        with self._cond:
            if wait and self._pending and not self._has_done():
                self._cond.wait(IDLE_WAIT)
            if not self._has_done():
                return None
            done, self._done = self._done, KVConnectorOutput()
        return done

    def _has_done(self) -> bool:
        d = self._done
        return bool(d.finished_loads or d.saved_keys or d.failed_save_keys or d.removed_keys)

    @torch.inference_mode()
    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                if isinstance(item, KVLoad):
                    self._load(item)
                else:
                    self._save(*item)
            except Exception:  # the thread must go on: the transfer is reported as failed
                log.exception("KV disk tier: a transfer failed")
                self._report_failure(item)
            with self._cond:
                self._pending -= 1
                if not isinstance(item, KVLoad):
                    self._staged -= item[1].numel()
                self._cond.notify_all()

    def _report_failure(self, item: object) -> None:
        with self._cond:
            if isinstance(item, KVLoad):
                if item.req_id not in self._done.finished_loads:
                    self._done.finished_loads.append(item.req_id)
                    self._done.num_loaded_blocks.append(0)
            else:
                self._done.failed_save_keys.append(item[0])  # type: ignore[index]

    def _save(self, key: bytes, data: torch.Tensor) -> None:
        try:
            size = self._store_making_room(key, data.numpy().data)
        except (OSError, sqlite3.Error) as e:
            self._warn_once(f"cannot write a block ({e}); it stays in memory only")
            with self._cond:
                self._done.failed_save_keys.append(key)
            return
        self._warned = False
        try:
            self._drop(self.index.evict(self.budget))
        except sqlite3.Error as e:  # the block is saved; the tier stays over its bound until the next save
            log.warning("KV disk tier: cannot evict (%s)", e)
        with self._cond:
            self._done.saved_keys.append(key)
            self._done.save_bytes += size

    def _store_making_room(self, key: bytes, payload: memoryview) -> int:
        """Write the block and enter it in the index. On a full file system, drop an eighth of the tier's bytes
        (a block at least, ROOM_BLOCKS at most) in eviction order and try once more: the file system, not only
        --kv-disk-bytes, bounds the tier. Should the index fail to record the drop, it lists files that are gone:
        misses when loaded."""
        try:
            return self._store(key, payload)
        except (OSError, sqlite3.Error) as e:
            if not _is_full(e) or not len(self.index):
                raise
        total = self.index.total_bytes()
        if not self._full_logged:
            self._full_logged = True
            log.warning("KV disk tier: the file system of %s is full at %.1f MiB of blocks; dropping the oldest "
                        "blocks to make room", self.layout.dir, total / 2**20)
        room = self.index.first_to_go(max(self.block_bytes, min(ROOM_BLOCKS * self.block_bytes, total // 8)))
        self._drop(room)  # the files first: SQLite needs room to record the drop
        self.index.remove(room)
        self.index.shrink_log()
        return self._store(key, payload)

    def _store(self, key: bytes, payload: memoryview) -> int:
        size = self.layout.write_block(key, payload)
        try:
            self.index.add([(key, size)], time.time())
        except sqlite3.Error:
            self.layout.remove_block(key)
            raise
        return size

    def _drop(self, keys: list[bytes]) -> None:
        """Blocks the index no longer lists: delete their files and report them removed."""
        for key in keys:
            self.layout.remove_block(key)
        with self._cond:
            self._done.removed_keys += keys

    def _warn_once(self, message: str) -> None:
        """A warning for the first failed save since the last one that succeeded; the rest at debug level."""
        (log.debug if self._warned else log.warning)("KV disk tier: %s", message)
        self._warned = True

    def _load(self, load: KVLoad) -> None:
        num_ok, nbytes, bad = 0, 0, None
        for block_id, key in zip(load.block_ids, load.keys, strict=True):
            try:
                payload = self.layout.read_block(key, self.block_bytes)
            except BlockFileError as e:
                log.warning("KV disk tier: %s; request %s computes its prefix from there", e, load.req_id)
                bad = key
                break
            copy_in(self.parts, block_id, payload)
            num_ok += 1
            nbytes += payload.nbytes
        try:  # bookkeeping only: the blocks loaded either way
            if bad is not None:
                self.index.remove([bad])
            self.index.touch(load.keys[:num_ok], time.time())
        except sqlite3.Error as e:
            log.warning("KV disk tier: cannot update the index after a load (%s)", e)
        with self._cond:
            d = self._done
            d.finished_loads.append(load.req_id)
            d.num_loaded_blocks.append(num_ok)
            d.load_bytes += nbytes
        if bad is not None:
            self.layout.remove_block(bad)
            with self._cond:
                self._done.num_failed_blocks += 1
                self._done.removed_keys.append(bad)

    def shutdown(self) -> None:
        """Finish every transfer sent (each save sent is then on disk)."""
        self._queue.put(None)
        self._thread.join()
        self.index.close()


def _is_full(error: Exception) -> bool:
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return getattr(error, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
