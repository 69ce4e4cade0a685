"""A sparse mixture-of-experts block (Qwen3-MoE, Mixtral, OLMoE).

The router picks each token's top-k experts (softmax in fp32, top-k, optionally renormalised to sum to 1). The
(token, expert) pairs are sorted by expert, so that each expert runs once, as two matmuls over all the tokens
routed to it, never once per token; one index_add sums the weighted outputs back into the tokens' rows (in
expert order, as transformers adds them). Every rank holds every expert's slice of the intermediate dim (gate
and up rows, down columns), so the ranks' partial sums meet in one all-reduce, as a dense MLP's do.
"""

from types import ModuleType

import torch
import torch.nn.functional as F

from protocol.model.config import ModelConfig
from worker.model.layers import ColumnParallelLinear, act_and_mul, row_shard, separate
from worker.model.layout import Layout
from worker.model.linear_method import make_linear
from worker.model.weights import WeightSource
from worker.parallel import TPGroup


class SparseMoE:
    def __init__(self, cfg: ModelConfig, src: WeightSource, prefix: str, tp: TPGroup, ops: ModuleType | None,
                 layout: Layout, **to):
        self.router = src.read(f"{prefix}.gate.weight").to(**to)  # [experts, hidden], on every rank
        inter = cfg.moe_intermediate_size
        gate, up, down = layout.expert_names
        experts = [f"{prefix}.experts.{e}" for e in range(cfg.num_experts)]
        # per expert: gate and up rows [2 * inter / tp, hidden], down columns [hidden, inter / tp]
        self.w13 = [ColumnParallelLinear(src, separate([f"{p}.{gate}", f"{p}.{up}"], [inter, inter]), tp, False, **to)
                    for p in experts]
        self.w2 = [make_linear([row_shard(src, f"{p}.{down}", inter, tp)], None, src.quantization, **to)
                   for p in experts]
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.act, self.ops, self.tp = cfg.hidden_act, ops, tp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's expert weights and ids, [tokens, top_k] each."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        rows = order // self.top_k
        counts = torch.bincount(flat, minlength=len(self.w13)).tolist()
        gathered = x.index_select(0, rows)
        outputs = torch.empty_like(gathered)
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = act_and_mul(self.w13[e](gathered[start : start + n]), self.act, self.ops)
                outputs[start : start + n] = self.w2[e](h)
                start += n
        outputs *= weights.flatten().index_select(0, order).unsqueeze(1)
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, rows, outputs))
