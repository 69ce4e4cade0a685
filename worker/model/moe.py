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
from worker.model.layers import act_and_mul
from worker.model.layout import Layout
from worker.model.weights import WeightSource
from worker.parallel import TPGroup, shard_range


class SparseMoE:
    def __init__(self, cfg: ModelConfig, src: WeightSource, prefix: str, tp: TPGroup, ops: ModuleType | None,
                 layout: Layout, **to):
        self.router = src.read(f"{prefix}.gate.weight").to(**to)  # [experts, hidden], on every rank
        start, end = shard_range(cfg.moe_intermediate_size, tp.rank, tp.size)
        gate, up, down = layout.expert_names
        w13, w2 = [], []
        for e in range(cfg.num_experts):
            p = f"{prefix}.experts.{e}"
            rows = [src.read(f"{p}.{name}.weight", 0, start, end) for name in (gate, up)]
            w13.append(torch.cat(rows).to(**to))
            w2.append(src.read(f"{p}.{down}.weight", 1, start, end).to(**to))
        self.w13, self.w2 = torch.stack(w13), torch.stack(w2)  # [experts, 2 * inter / tp, hidden], [.., hidden, ..]
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
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        gathered = x.index_select(0, rows)
        outputs = torch.empty_like(gathered)
        start = 0
        for e, n in enumerate(counts):
            if n:
                h = act_and_mul(F.linear(gathered[start : start + n], self.w13[e]), self.act, self.ops)
                outputs[start : start + n] = F.linear(h, self.w2[e])
                start += n
        outputs *= weights.flatten().index_select(0, order).unsqueeze(1)
        return self.tp.all_reduce(torch.zeros_like(x).index_add_(0, rows, outputs))
