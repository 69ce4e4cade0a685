"""Architecture name -> native implementation: the decoder layer type and how the architecture names its weights."""

from dataclasses import dataclass

from worker.model.gemma import GemmaDecoderLayer
from worker.model.layout import LLAMA, Layout
from worker.model.llama import DecoderLayer


@dataclass(frozen=True)
class Native:
    layer_type: type = DecoderLayer
    layout: Layout = LLAMA


_PHI3 = Layout(fused_qkv=True, fused_gate_up=True)
_MIXTRAL = Layout(moe_block="block_sparse_moe", expert_names=("w1", "w3", "w2"))

NATIVE: dict[str, Native] = {
    "LlamaForCausalLM": Native(),
    "Qwen2ForCausalLM": Native(),
    "Qwen3ForCausalLM": Native(),
    "MistralForCausalLM": Native(),
    "Phi3ForCausalLM": Native(layout=_PHI3),
    "SmolLM3ForCausalLM": Native(),
    "Gemma2ForCausalLM": Native(GemmaDecoderLayer),
    "Gemma3ForCausalLM": Native(GemmaDecoderLayer),
    "Qwen3MoeForCausalLM": Native(),
    "MixtralForCausalLM": Native(layout=_MIXTRAL),
    "OlmoeForCausalLM": Native(),
}
