"""The sparse MoE block against transformers' own (Qwen3-MoE, Mixtral, OLMoE) on the same weights: whole, split
over two tensor-parallel ranks (each holding every expert's slice of the intermediate dim), and run as one pair of
matmuls per expert hit whatever the number of tokens."""

import pytest
import torch

from protocol.model.config import ModelConfig
from tests.worker.family_support import config_of, randomize, raw_config_of
from worker.model.moe import SparseMoE
from worker.model.registry import NATIVE
from worker.model.weights import WeightSource
from worker.parallel import TPGroup

transformers = pytest.importorskip("transformers")

BLOCKS = {  # family -> transformers' sparse block class
    "qwen3_moe": "models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
    "mixtral": "models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "olmoe": "models.olmoe.modeling_olmoe.OlmoeSparseMoeBlock",
}


class SummedLater(TPGroup):
    """One rank of two, in this process: the test sums the ranks' outputs itself."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def hf_block(family: str):
    import importlib

    module, name = BLOCKS[family].rsplit(".", 1)
    block = getattr(importlib.import_module(f"transformers.{module}"), name)(config_of(family)).eval()
    randomize(block, seed=3)
    return block


def checkpoint_tensors(block, family: str, prefix: str) -> dict[str, torch.Tensor]:
    """The block's weights as a checkpoint names them: one tensor per expert and projection (transformers 5 keeps
    them stacked in memory and splits them when it saves)."""
    gate, up, down = NATIVE[ModelConfig.from_dict(raw_config_of(family)).architecture].layout.expert_names
    inter = block.experts.down_proj.shape[-1]
    out = {f"{prefix}.gate.weight": block.gate.weight.detach()}
    for e in range(block.experts.gate_up_proj.shape[0]):
        gate_up = block.experts.gate_up_proj[e].detach()
        out[f"{prefix}.experts.{e}.{gate}.weight"] = gate_up[:inter]
        out[f"{prefix}.experts.{e}.{up}.weight"] = gate_up[inter:]
        out[f"{prefix}.experts.{e}.{down}.weight"] = block.experts.down_proj[e].detach()
    return out


def ours(family: str, block, tp: TPGroup) -> SparseMoE:
    cfg = ModelConfig.from_dict(raw_config_of(family))
    layout = NATIVE[cfg.architecture].layout
    src = WeightSource(tensors=checkpoint_tensors(block, family, "moe"))
    return SparseMoE(cfg, src, "moe", tp, None, layout, dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("family", list(BLOCKS))
def test_moe_block_matches_transformers(family, tokens):
    block = hf_block(family)
    x = torch.randn(tokens, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        expected = block(x.unsqueeze(0))[0]
        whole = ours(family, block, TPGroup())(x)
        split = sum(ours(family, block, SummedLater(rank, 2))(x) for rank in range(2))
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(split, expected, rtol=1e-5, atol=1e-5)


def test_experts_run_once_each_not_once_per_token(monkeypatch):
    """64 tokens over 8 experts: the router's matmul and two per expert, at most 17 in all."""
    block = hf_block("qwen3_moe")
    moe = ours("qwen3_moe", block, TPGroup())
    calls = []
    linear = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a, **k: calls.append(1) or linear(*a, **k))
    with torch.inference_mode():
        moe(torch.randn(64, block.gate.weight.shape[1]))
    assert len(calls) <= 1 + 2 * 8
