"""Seeded scheduler workloads, replayed op by op on one side (kvengine's EngineCore here, vLLM's scheduler in
vllm_runner.py), and the traces both sides record.

Each workload is a seeded list of ops (add a request: prompt token ids, sometimes after a shared prefix so prefix
caching hits, max_tokens, sometimes a stop token id it will meet; abort one request; step k times; finally step until
idle) on a small block pool (block size 16, so preemption happens), a token budget, max_num_seqs, prefix caching on,
greedy, ignore_eos; and the settings under test: long_prefill_token_threshold, the scheduling policy, chunked prefill.
Tokens are a function of the request's token history (kvengine's reference_next_token), so both sides sample the same
ones.

Recorded per schedule call that sends anything: each scheduled request's id with its full block ids and
num_computed_tokens (new or resumed) or its appended block ids (running), num_scheduled_tokens in order, preempted and
finished ids; per update call: the step it applies and each client output (tokens, finish reason; an abort's own
output is not recorded: vLLM's scheduler makes none); the ops in between.

vLLM's venv imports this module too: only the standard library at the top.
"""

import json
import random

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


class KvengineSide:
    """kvengine's real EngineCore with the ReferenceExecutor (block-table digests checked); its scheduler's
    schedule() and update_from_output() record each call (imported here: vLLM's venv never builds this side)."""

    def __init__(self, wl: dict, async_scheduling: bool) -> None:
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


def compare_mode(workloads: list[dict], mode: str, theirs: dict) -> tuple[list[str], list[int]]:
    """Replay each workload on kvengine in one mode and compare with vLLM's traces (keyed "SEED/MODE"): one report
    per workload that differs (its first differing event, with both sides' records), and kvengine's coverage totals
    (schedules, preempted, hits, stops, lengths)."""
    reports, totals = [], [0, 0, 0, 0, 0]
    for wl in workloads:
        key = f"{wl['seed']}/{mode}"
        ours = replay(wl, KvengineSide(wl, mode == "async"))
        totals = [a + b for a, b in zip(totals, coverage(ours), strict=True)]
        i = first_difference(ours, theirs[key])
        if i is not None:
            reports.append(difference_report(wl, mode, ours, theirs[key], i))
    return reports, totals


def difference_report(wl: dict, mode: str, ours: list, theirs: list, i: int) -> str:
    step = max([e["schedule"] for e in ours[:i] if isinstance(e, dict)], default=0)
    where = f"blocks {wl['num_blocks']}, budget {wl['budget']}, max_num_seqs {wl['max_num_seqs']}"
    lines = [f"seed {wl['seed']} {mode}: differ at event {i} (after schedule {step}); {where}"]
    if i:
        lines.append(f"  both     {show(ours, i - 1)}")
    lines += [f"  kvengine {show(ours, i)}", f"  vllm     {show(theirs, i)}"]
    rest = first_difference(without_empty_updates(ours), without_empty_updates(theirs))
    lines.append("  with updates that return no outputs left out: " + ("match" if rest is None else f"differ at {rest}"))
    return "\n".join(lines)
