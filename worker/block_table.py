"""Per KV cache group block tables: int32 [max_num_reqs, max_num_blocks_per_req], rows reused.

Changes go to a host copy (numpy, no tensor per change); on CUDA it is pinned, and `commit` copies the rows
that changed (the span from the first to the last) to the device table once per step, before the step reads it.
"""

import torch

from protocol import block_ids_digest


class BlockTableMismatch(RuntimeError):
    """The worker's block table disagrees with the ledger's digest (--check-block-tables)."""


class BlockTable:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, device="cpu"):
        device = torch.device(device)
        self.host = torch.zeros(max_num_reqs, max_num_blocks_per_req, dtype=torch.int32,
                                pin_memory=device.type == "cuda")
        self.np = self.host.numpy()
        self.table = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.num_blocks = [0] * max_num_reqs
        self.changed = range(0)  # rows the device table has yet to receive

    def overwrite(self, row: int, block_ids: list[int]) -> None:
        self._check_room(row, len(block_ids))
        self.np[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self._changed(row)

    def append(self, row: int, block_ids: list[int]) -> None:
        n = self.num_blocks[row]
        self._check_room(row, n + len(block_ids))
        self.np[row, n : n + len(block_ids)] = block_ids
        self.num_blocks[row] = n + len(block_ids)
        self._changed(row)

    def clear(self, row: int) -> None:
        self.num_blocks[row] = 0

    def block_ids(self, row: int) -> list[int]:
        return self.np[row, : self.num_blocks[row]].tolist()

    def null_skipped(self, row: int, num_skipped_blocks: int) -> None:
        """Mirror the ledger: blocks that left a sliding window become the null block 0."""
        n = min(num_skipped_blocks, self.num_blocks[row])
        if self.np[row, :n].any():
            self.np[row, :n] = 0
            self._changed(row)

    def _changed(self, row: int) -> None:
        c = self.changed
        self.changed = range(min(row, c.start), max(row + 1, c.stop)) if c else range(row, row + 1)

    def commit(self) -> None:
        """Copy the changed rows to the device (without waiting); on the CPU the host table is the table."""
        if self.changed and self.table is not self.host:
            rows = slice(self.changed.start, self.changed.stop)
            self.table[rows].copy_(self.host[rows], non_blocking=True)
        self.changed = range(0)

    def _check_room(self, row: int, n: int) -> None:
        if n > self.table.shape[1]:
            raise ValueError(f"row {row} needs {n} blocks, the table holds {self.table.shape[1]} (max_model_len)")


class BlockTables:
    """One BlockTable per KV cache group, sharing a free list of rows."""

    def __init__(self, num_groups: int, max_num_reqs: int, max_num_blocks_per_req: int, device="cpu"):
        self.groups = [BlockTable(max_num_reqs, max_num_blocks_per_req, device) for _ in range(num_groups)]
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        self.rows: dict[str, int] = {}

    def add(self, req_id: str, block_ids: list[list[int]]) -> int:
        """A new or resumed request: take a row (or keep its row) and overwrite it."""
        if req_id not in self.rows:
            if not self.free_rows:
                raise RuntimeError(f"no free block table row for {req_id}: more than max_num_seqs requests")
            self.rows[req_id] = self.free_rows.pop()
        row = self.rows[req_id]
        for table, ids in zip(self.groups, block_ids, strict=True):
            table.overwrite(row, ids)
        return row

    def append(self, req_id: str, new_block_ids: list[list[int]]) -> None:
        row = self.rows[req_id]
        for table, ids in zip(self.groups, new_block_ids, strict=True):
            table.append(row, ids)

    def free(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            for table in self.groups:
                table.clear(row)
            self.free_rows.append(row)

    def commit(self) -> None:
        for table in self.groups:
            table.commit()

    def block_ids(self, req_id: str) -> list[list[int]]:
        return [table.block_ids(self.rows[req_id]) for table in self.groups]

    def verify(self, req_id: str, digest: bytes) -> None:
        mine = self.block_ids(req_id)
        if block_ids_digest(mine) != digest:
            raise BlockTableMismatch(
                f"block table of request {req_id!r} (row {self.rows[req_id]}) disagrees with the ledger's digest; "
                f"worker has {mine}"
            )
