"""Building blocks of a decoder, sharded for tensor parallelism."""

import math
from types import ModuleType

import torch
import torch.nn.functional as F

from worker.model.linear_method import DenseLinear, HalfLinear, make_linear
from worker.model.weights import WeightSource
from worker.ops.quant_linear import Int4Linear
from worker.parallel import TPGroup, shard_range


class RMSNorm:
    """ops: the CPU extension, whose fused kernels replace the torch ops below (same rounding), or None."""

    def __init__(self, weight: torch.Tensor, eps: float, ops: ModuleType | None = None):
        self.weight, self.eps, self.ops = weight, eps, ops

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and this norm: (x + delta, its norm); fused, x is updated in place."""
        if self.ops is not None:
            return x, self.ops.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


def norm(src: WeightSource, name: str, eps: float, offset: float, ops: ModuleType | None, **to) -> RMSNorm:
    """The RMS norm of weight `name`; offset 1 for Gemma's, which scale by 1 + weight."""
    weight = src.read(f"{name}.weight")
    return RMSNorm((weight.float() + offset).to(**to) if offset else weight.to(**to), eps, ops)


def silu_and_mul(x: torch.Tensor, ops: ModuleType | None) -> torch.Tensor:
    """silu(gate) * up, gate and up the two halves of x's last dim."""
    if ops is not None:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def act_and_mul(x: torch.Tensor, act: str, ops: ModuleType | None) -> torch.Tensor:
    """act(gate) * up: SwiGLU (silu, fused by ops) or GeGLU (gelu, exact or tanh-approximated as transformers'
    gelu_pytorch_tanh)."""
    if act == "silu":
        return silu_and_mul(x, ops)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh" if act == "gelu_pytorch_tanh" else "none") * up


Part = tuple[str, int, int]  # an HF weight's name, first row and row count


def separate(names: list[str], sizes: list[int]) -> list[Part]:
    """Parts that are whole HF weights (q_proj, k_proj, v_proj)."""
    return [(name, 0, size) for name, size in zip(names, sizes, strict=True)]


def fused(name: str, sizes: list[int]) -> list[Part]:
    """Parts that are row ranges of one HF weight (Phi-3's qkv_proj and gate_up_proj)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(name, start, size) for start, size in zip(starts, sizes, strict=True)]


class ColumnParallelLinear:
    """Output features split across ranks; each part (a weight, or rows of a fused one) split on its own, the
    rank's shards stacked along the output dim into one linear (worker/model/linear_method.py)."""

    def __init__(self, src: WeightSource, parts: list[Part], tp: TPGroup, bias: bool, **to):
        weights, biases = [], []
        for name, first, size in parts:
            start, end = shard_range(size, tp.rank, tp.size)
            weights.append(src.read_linear(f"{name}.weight", 0, first + start, first + end))
            if bias:
                biases.append(src.read(f"{name}.bias", 0, first + start, first + end))
        self.linear = make_linear(weights, torch.cat(biases) if bias else None, src.quantization, **to)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class RowParallelLinear:
    """Input features split across ranks; partial outputs summed with an all-reduce, then the bias added."""

    def __init__(self, src: WeightSource, name: str, size_in: int, tp: TPGroup, bias: bool = False, **to):
        self.linear = make_linear([row_shard(src, name, size_in, tp)], None, src.quantization, **to)
        self.bias = src.read(f"{name}.bias").to(**to) if bias else None
        self.tp = tp

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(self.linear(x))
        return out if self.bias is None else out + self.bias


def row_shard(src: WeightSource, name: str, size_in: int, tp: TPGroup):
    """This rank's input columns of weight `name` (a quantized one split on block boundaries, or refused)."""
    start, end = shard_range(size_in, tp.rank, tp.size)
    return src.read_linear(f"{name}.weight", 1, start, end)


class VocabParallelEmbedding:
    """Rows of the vocabulary split across ranks (padded to a multiple of the TP size)."""

    def __init__(self, src: WeightSource, name: str, vocab_size: int, tp: TPGroup, **to):
        per = math.ceil(vocab_size / tp.size)
        self.start = tp.rank * per
        end = min(self.start + per, vocab_size)
        rows = src.read(name, 0, self.start, end).to(**to)
        self.weight = torch.cat([rows, rows.new_zeros(per - rows.shape[0], rows.shape[1])])
        self.vocab_size, self.tp = vocab_size, tp

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead:
    """The LM head: vocabulary rows split across ranks as VocabParallelEmbedding's, multiplied by the linear of its
    weight (packed dense; a GGUF file's Q8_0 / Q4 head stays quantized, --quantization rtn leaves it dense)."""

    def __init__(self, src: WeightSource, name: str, vocab_size: int, tp: TPGroup, **to):
        per = math.ceil(vocab_size / tp.size)
        start = tp.rank * per
        end = min(start + per, vocab_size)
        rows = src.read_linear(name, 0, start, end)
        parts = [rows] if end - start == per else [rows, torch.zeros(per - (end - start), rows.shape[1])]
        self.linear = make_linear(parts, None, None, **to)
        self.vocab_size, self.tp = vocab_size, tp

    @property
    def weight(self) -> torch.Tensor:
        """The weight as its kernel holds it (packed, or codes); the runner reads its device."""
        linear = self.linear
        return linear.weight if isinstance(linear, (DenseLinear, HalfLinear)) else linear.packed if isinstance(
            linear, Int4Linear) else linear.q

    def logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0 (None elsewhere)."""
        full = self.tp.gather_last_dim(self.linear(h))
        return None if full is None else full[..., : self.vocab_size]
