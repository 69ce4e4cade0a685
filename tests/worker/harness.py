"""Test-side driver: a tiny allocator + scheduler that feeds SchedulerOutputs to a Worker.

It hands out block ids per KV cache group, reuses full prefix blocks of earlier requests, prefills
in chunks, puts the null block where a sliding window has moved past, and sends block table digests
so the worker checks its tables every step.
"""

from dataclasses import dataclass, field

import torch

from engine_core.kv_cache.planning import get_kv_cache_groups
from protocol import (
    CachedRequestData,
    KVCacheConfig,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
    SlidingWindowSpec,
    block_ids_digest,
)
from worker.worker import Worker


def kv_config(worker: Worker, num_blocks: int) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=get_kv_cache_groups(worker.kv_cache_specs()))


@dataclass
class Req:
    req_id: str
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    outputs: list[int] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)
    num_computed: int = 0
    sent: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs

    @property
    def done(self) -> bool:
        return len(self.outputs) >= self.max_tokens


class Driver:
    def __init__(self, worker: Worker, cfg: KVCacheConfig, chunk: int = 1 << 30, prefix_caching: bool = True):
        self.worker, self.cfg, self.chunk, self.prefix_caching = worker, cfg, chunk, prefix_caching
        self.block_size = cfg.kv_cache_groups[0].kv_cache_spec.block_size
        self.next_block = 1  # block 0 is the null block
        self.cached: list[dict[tuple, int]] = [{} for _ in cfg.kv_cache_groups]
        self.step = 0
        self.num_prefix_hit_tokens = 0

    def _new_block(self) -> int:
        if self.next_block >= self.cfg.num_blocks:
            raise RuntimeError("test pool exhausted")
        self.next_block += 1
        return self.next_block - 1

    def _admit(self, req: Req) -> None:
        """Take cached prefix blocks (never covering the last prompt token)."""
        bs, hits = self.block_size, []
        if self.prefix_caching:
            for b in range((len(req.tokens) - 1) // bs):
                key = tuple(req.tokens[: (b + 1) * bs])
                if not all(key in c for c in self.cached):
                    break
                hits.append([c[key] for c in self.cached])
        req.blocks = [[h[g] for h in hits] for g in range(len(self.cached))]
        req.num_computed = len(hits) * bs
        self.num_prefix_hit_tokens += req.num_computed

    def _null_window(self, req: Req) -> None:
        for g, group in enumerate(self.cfg.kv_cache_groups):
            spec = group.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                skipped = max(0, req.num_computed - spec.sliding_window + 1) // self.block_size
                req.blocks[g][:skipped] = [0] * min(skipped, len(req.blocks[g]))

    def run(self, prompts: list[list[int]], max_tokens: int | list[int],
            params: SamplingParams | list[SamplingParams] | None = None):
        params = params or SamplingParams(temperature=0.0, max_tokens=1 << 20)
        lens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        each = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [Req(f"r{self.step}-{i}", p, n, q)
                for i, (p, n, q) in enumerate(zip(prompts, lens, each, strict=True))]
        finished: list[str] = []
        while not all(r.done for r in reqs):
            finished += self.step_once([r for r in reqs if not r.done], finished)
        self.step_once([], finished)
        return [r.outputs for r in reqs]

    def step_once(self, running: list[Req], finished: list[str]) -> list[str]:
        new, cached, counts = [], CachedRequestData(), {}
        for req in running:
            if not req.sent:
                self._admit(req)
            self._null_window(req)
            n = min(self.chunk, len(req.tokens) - req.num_computed)
            need = -(-(req.num_computed + n) // self.block_size)
            added = [[self._new_block() for _ in range(need - len(b))] for b in req.blocks]
            for b, a in zip(req.blocks, added, strict=True):
                b.extend(a)
            counts[req.req_id] = n
            if not req.sent:
                new.append(
                    NewRequestData(req.req_id, req.prompt, req.outputs, req.params, req.blocks, req.num_computed)
                )
            else:
                cached.req_ids.append(req.req_id)
                cached.new_block_ids.append(added if any(added) else None)
                cached.num_computed_tokens.append(req.num_computed)
        so = SchedulerOutput(
            step=self.step,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=counts,
            total_num_scheduled_tokens=sum(counts.values()),
            finished_req_ids=list(finished),
            block_table_digests={r.req_id: block_ids_digest(r.blocks) for r in running},
        )
        finished.clear()
        self.step += 1
        out = self.worker.execute_model(so)
        sampled = dict(zip(out.req_ids, out.sampled_token_ids, strict=True))
        done = []
        for req in running:
            req.sent = True
            req.num_computed += counts[req.req_id]
            self._register(req)
            req.outputs += sampled[req.req_id]
            if req.done:
                done.append(req.req_id)
        return done

    def _register(self, req: Req) -> None:
        bs = self.block_size
        for b in range(req.num_computed // bs):
            key = tuple(req.tokens[: (b + 1) * bs])
            for g, c in enumerate(self.cached):
                if req.blocks[g][b] != 0:
                    c.setdefault(key, req.blocks[g][b])


def hf_greedy(folder, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=0)
            outs.append(gen[0, len(p) :].tolist())
    return outs
