"""Tensor-parallel group: rank, size and the collectives the model and sampler use."""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1

    @classmethod
    def init(cls, rank: int, size: int, device: torch.device, init_method: str | None) -> "TPGroup":
        """Join the process group (gloo on CPU, nccl on CUDA); a size of 1 needs none."""
        if size > 1 and not dist.is_initialized():
            if init_method is None:
                raise ValueError("tensor parallel size > 1 needs dist_init_method (e.g. tcp://127.0.0.1:PORT)")
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
        return cls(rank, size)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's shard along the last dim on rank 0; other ranks get None."""
        if self.size == 1:
            return x
        if self.rank != 0:
            dist.gather(x.contiguous(), None, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.broadcast(x, src=0)
        return x

    def shutdown(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of an even split of `total` rows across ranks (total must divide)."""
    per = total // size
    return rank * per, (rank + 1) * per
