"""How an architecture names and packs its weights, where it differs from Llama's."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    fused_qkv: bool = False  # one qkv_proj (Phi-3)
    fused_gate_up: bool = False  # one gate_up_proj (Phi-3)
    moe_block: str = "mlp"  # the sparse block's name in a layer (Mixtral: block_sparse_moe)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down (Mixtral: w1, w3, w2)


LLAMA = Layout()
