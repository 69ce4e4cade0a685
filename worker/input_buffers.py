"""Persistent buffers for one step's inputs, allocated once and filled in place every step.

Each buffer has a host tensor, filled through a numpy view of it; on CUDA the host tensor is pinned and
copied to a device twin asynchronously, on the CPU it is itself the buffer. The device tensors keep their
addresses for the life of the runner, which is what a CUDA graph replayed on them needs.
"""

import numpy as np
import torch

from worker.attention import StepRequests


class HostDeviceBuffer:
    def __init__(self, size: int, dtype: torch.dtype, device: torch.device):
        self.host = torch.zeros(size, dtype=dtype, pin_memory=device.type == "cuda")
        self.np = self.host.numpy()
        self.device = self.host if device.type == "cpu" else torch.zeros(size, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        """The first n entries on the device (copied there, without waiting, when the device is not the CPU)."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


class StepBuffers:
    """A step's token ids, positions and per-request counts; for the in-place kernels also the int32 offsets,
    lengths and each KV cache group's block table rows of the scheduled requests."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_num_blocks: int, num_groups: int,
                 device: torch.device):
        self.max_num_tokens, self.max_num_reqs, self.max_num_blocks = max_num_tokens, max_num_reqs, max_num_blocks
        self.input_ids, self.positions, self.token_rows = (
            HostDeviceBuffer(max_num_tokens, torch.int64, device) for _ in range(3)
        )
        self.rows, self.num_computed, self.num_scheduled, self.query_start, self.sample_rows = (
            HostDeviceBuffer(max_num_reqs, torch.int64, device) for _ in range(5)
        )
        self.query_start_loc = HostDeviceBuffer(max_num_reqs + 1, torch.int32, device)
        self.seq_lens = HostDeviceBuffer(max_num_reqs, torch.int32, device)
        self.block_tables = [torch.zeros(max_num_reqs * max_num_blocks, dtype=torch.int32, device=device)
                             for _ in range(num_groups)]
        self.arange = np.arange(max_num_tokens)
        # Pinned host memory may be rewritten only after the copies that read it have run on the device.
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def wait_for_copies(self) -> None:
        """Before the host buffers (and the block tables' host copies) change for the next step."""
        if self.copied is not None:
            self.copied.synchronize()

    def fill(self, ids: list[int], rows: list[int], computed: list[int], counts: list[int],
             num_padded_tokens: int, num_padded_reqs: int) -> StepRequests:
        """The step's requests in batch order; tokens up to num_padded_tokens are id 0 at position 0. With
        num_padded_reqs > len(rows), each token past the real ones is a padding request of its own (one query, one
        key), whose block table row the caller points at a block no real request uses (CUDA graph batches)."""
        n, t = len(rows), len(ids)
        if num_padded_tokens > self.max_num_tokens or num_padded_reqs > self.max_num_reqs:
            raise ValueError(f"a step of {num_padded_tokens} tokens for {num_padded_reqs} requests exceeds the "
                             f"buffers ({self.max_num_tokens} tokens, {self.max_num_reqs} requests)")
        self.input_ids.np[:t] = ids
        self.input_ids.np[t:num_padded_tokens] = 0
        self.rows.np[:n] = rows
        nc, ns, qs = self.num_computed.np[:n], self.num_scheduled.np[:n], self.query_start.np[:n]
        nc[:] = computed
        ns[:] = counts
        np.cumsum(ns, out=qs)
        qs -= ns
        self.positions.np[:t] = self.arange[:t] + np.repeat(nc - qs, ns)
        self.positions.np[t:num_padded_tokens] = 0
        self.token_rows.np[:t] = np.repeat(self.rows.np[:n], ns)
        m = max(n, num_padded_reqs)
        qsl = self.query_start_loc.np
        qsl[0] = 0
        np.cumsum(ns, out=qsl[1 : n + 1])
        qsl[n + 1 : m + 1] = t + self.arange[1 : m - n + 1]  # padding requests: one token each
        self.seq_lens.np[:n] = nc + ns
        self.seq_lens.np[n:m] = 1
        reqs = StepRequests(
            rows=self.rows.to_device(n),
            num_computed=self.num_computed.to_device(n),
            num_scheduled=self.num_scheduled.to_device(n),
            query_start=self.query_start.to_device(n),
            positions=self.positions.to_device(num_padded_tokens)[:t],
            token_rows=self.token_rows.to_device(t),
            query_start_loc=self.query_start_loc.to_device(m + 1),
            seq_lens=self.seq_lens.to_device(m),
            max_query_len=max(counts, default=1 if m > n else 0),
        )
        self.input_ids.to_device(num_padded_tokens)
        return reqs

    def padded_positions(self, num_padded_tokens: int) -> torch.Tensor:
        return self.positions.device[:num_padded_tokens]

    def padded_input_ids(self, num_padded_tokens: int) -> torch.Tensor:
        return self.input_ids.device[:num_padded_tokens]

    def gather_block_tables(self, tables: list[torch.Tensor], rows: torch.Tensor, num_blocks: int,
                            num_padded_reqs: int, pad_block: int) -> list[torch.Tensor]:
        """Per group, the scheduled requests' rows [reqs, num_blocks] of its block table, into the persistent
        buffer; padding requests' rows hold pad_block first."""
        out = []
        for table, buf in zip(tables, self.block_tables, strict=True):
            rows_out = buf[: max(len(rows), num_padded_reqs) * num_blocks].view(-1, num_blocks)
            torch.index_select(table[:, :num_blocks], 0, rows, out=rows_out[: len(rows)])
            if num_padded_reqs > len(rows):
                rows_out[len(rows) :, 0] = pad_block
            out.append(rows_out)
        return out

    def sample_indices(self, samplers: list[int], num_reqs: int) -> torch.Tensor | None:
        """Rows of the step's hidden states to sample from: the last token of each sampling request; None when
        they are the first num_reqs rows in order (a decode step)."""
        if len(samplers) == num_reqs and int(self.num_scheduled.np[:num_reqs].max()) == 1:
            return None
        k = len(samplers)
        last = self.query_start.np[:num_reqs] + self.num_scheduled.np[:num_reqs] - 1
        self.sample_rows.np[:k] = last[samplers]
        return self.sample_rows.to_device(k)

    def record_copies(self) -> None:
        if self.copied is not None:
            self.copied.record()
