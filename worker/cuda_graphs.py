"""CUDA graphs for decode steps, as vLLM's: captured once per batch size after the KV cache is allocated,
replayed on the runner's persistent input buffers; --enforce-eager turns them off.

A decode batch of n requests (one query each) runs as the smallest captured size B >= n: requests n..B-1
are padding, one token each (id 0 at position 0) whose K/V goes to a pad block past the ledger's blocks,
which no real request uses, and only the first n rows of the output are read. A batch that is not a pure
decode, or larger than the largest size, runs eagerly. All of it but the capture and the replay (the
bucket, the padding, the buffers, the slicing) is the same on the CPU, where a padded batch runs eagerly.
"""

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8 up to max_num_seqs (at most 512), and that limit itself."""
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    return sorted({s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top} | {top})


def cuda_graph_sizes(device: torch.device, enforce_eager: bool, backend: str, tp_size: int,
                     max_num_seqs: int) -> list[int] | None:
    """The decode batch sizes to capture, or None (every step eager), with the reason logged."""
    if device.type != "cuda" or enforce_eager:
        return None
    if backend != "triton":
        log.info("CUDA graphs off: they need --attention-backend triton (the torch path plans on the host)")
        return None
    if tp_size > 1:
        log.info("CUDA graphs off: captured collectives are not supported here (tensor parallel size %d)", tp_size)
        return None
    return default_capture_sizes(max_num_seqs)


def decode_bucket(sizes: list[int] | None, counts: list[int]) -> int | None:
    """The padded size a step with these per-request query counts runs as, or None: eager, unpadded."""
    if not sizes or not counts or max(counts) != 1 or len(counts) > sizes[-1]:
        return None
    return next(s for s in sizes if s >= len(counts))


class CudaGraphs:
    """One graph per decode batch size, all in one memory pool (they never run at the same time)."""

    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def capture(self, sizes: list[int], prepare: Callable[[int], None], forward: Callable[[int], torch.Tensor]) -> None:
        """prepare(B) fills the persistent buffers with a batch of B padding requests; forward(B) runs the model
        on them and returns its hidden states, the graph's output. Each size is warmed up eagerly on a side
        stream first (Triton compiles, cuBLAS picks its kernels outside capture), largest size first so that
        the smaller graphs reuse the pool's memory."""
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in sorted(sizes, reverse=True):
            prepare(size)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                forward(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):  # captures on its own side stream
                self.outputs[size] = forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, size: int) -> torch.Tensor | None:
        """The hidden states of the padded batch of this size, or None where no graph was captured for it."""
        graph = self.graphs.get(size)
        if graph is None:
            return None
        graph.replay()
        return self.outputs[size]
