"""What the model runner needs of a model, whichever implementation serves it (LlamaModel or TransformersModel)."""

from collections.abc import Sequence
from typing import Protocol

import torch

from protocol.model.config import ModelConfig
from worker.attention_backends import Attention
from worker.parallel import TPGroup


class Layer(Protocol):
    @property
    def sliding_window(self) -> int | None:
        """The window its KV cache group must have, None for full attention."""
        ...


class LMHead(Protocol):
    @property
    def weight(self) -> torch.Tensor:
        """On the device where the logits will be."""
        ...


class CausalLM(Protocol):
    cfg: ModelConfig
    tp: TPGroup

    @property
    def layers(self) -> Sequence[Layer]: ...

    @property
    def lm_head(self) -> LMHead: ...

    @property
    def kv_heads_per_rank(self) -> int: ...

    @property
    def cuda_graphs(self) -> bool: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, num_tokens: int, caches: list, metas: list,
                attention: Attention) -> torch.Tensor:
        """The final hidden states of the step's first num_tokens tokens (the rest of input_ids is padding)."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Full-vocabulary logits on rank 0, None on the other ranks."""
        ...
