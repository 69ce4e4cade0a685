"""The dense gated MLP: down(act(gate(x)) * up(x)), gate and up one column-parallel matmul (separate weights or
Phi-3's fused gate_up_proj), down row-parallel."""

from types import ModuleType

import torch

from worker.model.layers import ColumnParallelLinear, RowParallelLinear, act_and_mul, fused, separate
from worker.model.layout import Layout
from worker.model.weights import WeightSource
from worker.parallel import TPGroup


class GatedMLP:
    def __init__(self, src: WeightSource, prefix: str, intermediate: int, act: str, bias: bool, tp: TPGroup,
                 ops: ModuleType | None, layout: Layout, **to):
        sizes = [intermediate, intermediate]
        parts = fused(f"{prefix}.gate_up_proj", sizes) if layout.fused_gate_up else separate(
            [f"{prefix}.gate_proj", f"{prefix}.up_proj"], sizes)
        self.gate_up = ColumnParallelLinear(src, parts, tp, bias, **to)
        self.down = RowParallelLinear(src, f"{prefix}.down_proj", intermediate, tp, bias, **to)
        self.act, self.ops = act, ops

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(act_and_mul(self.gate_up(h), self.act, self.ops))
