"""Records every decision the engine core makes over seeded workloads, to show that a change keeps them all.

    python -m bench.record_decisions --out DIR       # record; write DIR/sync.jsonl, DIR/async.jsonl, DIR/sha256.txt
    python -m bench.record_decisions --compare DIR   # record again; exit 1 at the first line that differs

The workloads are the vLLM conformance check's (tests/conformance/decisions.py, make_workload: adds with shared
prefixes and stop tokens the request will meet, aborts, steps, a final drain, on a pool small enough to preempt),
each seed under every combination of scheduling policy (fcfs, priority), chunked prefill (on, off),
long_prefill_token_threshold (off, 16) and prefix caching (on, off; KV cache events on for even seeds). Each runs
through the real EngineCore and ReferenceExecutor (block-table digests checked) in sync and in async scheduling.

One JSON line per event, in order: the workload's ops; every KVCacheManager call made from outside the
manager (method, arguments with a request shown as its id and progress, result, block lists as ids);
every SchedulerOutput (its fields, then its msgpack bytes in hex); every ModelRunnerOutput applied and
the client outputs that came of it; each step's outputs and SchedulerStats. One sha256 per mode is
printed: equal hashes, equal recordings.
"""

import argparse
import functools
import hashlib
import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import msgspec

import bench  # noqa: F401  (the checkout's root on the path for tests/, run as a file too)
from engine_core.core import EngineCore
from engine_core.executor.reference_executor import ReferenceExecutor
from engine_core.kv_cache.manager import KVCacheBlocks, KVCacheManager
from engine_core.request import Request
from protocol import EngineCoreRequest, FullAttentionSpec, SamplingParams
from protocol.config import engine_config
from tests.conformance.decisions import BLOCK_SIZE, VOCAB, make_workload, replay

MODES = ("sync", "async")
VARIANTS = list(itertools.product(("fcfs", "priority"), (True, False), (0, 16), (True, False)))
_to_builtins = functools.partial(msgspec.to_builtins, builtin_types=())
_msgpack = msgspec.msgpack.Encoder().encode
_json = msgspec.json.Encoder().encode


def plain(value: Any) -> Any:
    """A JSON-ready form of a ledger argument or result; anything unforeseen is an error, never dropped."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Request):
        return ["request", value.request_id, value.status.name, value.num_computed_tokens, value.num_tokens,
                value.num_output_placeholders, len(value.block_hashes)]
    if isinstance(value, KVCacheBlocks):
        return ["blocks", value.get_block_ids()]
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, msgspec.Struct):
        return _to_builtins(value)
    raise TypeError(f"no recorded form for {type(value).__name__}")


@contextmanager
def ledger_calls_recorded(record: Callable[[list], None]) -> Iterator[None]:
    """Every public KVCacheManager method records its calls (calls the manager makes to itself are left out)."""
    depth = [0]
    originals = {name: fn for name, fn in vars(KVCacheManager).items() if callable(fn) and not name.startswith("_")}

    def wrap(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def recorded(self, *args, **kwargs):
            depth[0] += 1
            try:
                result = fn(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if not depth[0]:
                record(["ledger", name, plain(args), {k: plain(v) for k, v in kwargs.items()}, plain(result)])
            return result

        return recorded

    for name, fn in originals.items():
        setattr(KVCacheManager, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(KVCacheManager, name, fn)


class RecordingSide:
    """One workload through EngineCore + ReferenceExecutor; replay() drives it, as it drives the conformance check's sides."""

    def __init__(self, wl: dict, async_scheduling: bool, prefix_caching: bool, record: Callable[[list], None]):
        self.record, self.events = record, []  # events: replay()'s log of the ops, recorded as they come
        self.arrivals = 0  # arrival times as the conformance check gives them: the priority policy breaks ties by them
        executor = ReferenceExecutor(kv_cache_specs={"layer.0": FullAttentionSpec(BLOCK_SIZE, 1, 8, 2)},
                                     vocab_size=VOCAB, max_position_embeddings=4096)
        config = engine_config(
            max_model_len=wl["max_model_len"], max_num_seqs=wl["max_num_seqs"], max_num_batched_tokens=wl["budget"],
            block_size=BLOCK_SIZE, enable_prefix_caching=prefix_caching, scheduling_policy=wl["policy"],
            enable_chunked_prefill=wl["chunked"], num_gpu_blocks_override=wl["num_blocks"], check_block_tables=True,
            long_prefill_token_threshold=wl["threshold"], async_scheduling=async_scheduling,
            kv_events_endpoint="tcp://127.0.0.1:1" if wl["seed"] % 2 == 0 else None,  # never bound: events only kept
        )
        self.core = EngineCore(config, executor)
        sched = self.core.scheduler
        schedule, update = sched.schedule, sched.update_from_output

        def recording_schedule():
            so = schedule()
            record(["schedule", _to_builtins(so), _msgpack(so).hex()])
            return so

        def recording_update(so, model_output):
            outputs = update(so, model_output)
            record(["update", so.step, _to_builtins(model_output), _to_builtins(outputs)])
            return outputs

        sched.schedule, sched.update_from_output = recording_schedule, recording_update

    def add(self, rid: str, prompt: list[int], max_tokens: int, stop: list[int], priority: int) -> None:
        self.flush_events()
        self.arrivals += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop)
        request = EngineCoreRequest(rid, prompt, params, float(self.arrivals), priority=priority)
        self.record(["add", _to_builtins(self.core.add_request(request))])

    def abort(self, rid: str) -> None:
        self.flush_events()
        self.core.abort_requests([rid])

    def busy(self) -> bool:
        return self.core.has_work()

    def step(self) -> None:
        self.flush_events()
        outputs = self.core.step()
        self.record(["step", _to_builtins(outputs.outputs), _to_builtins(self.core.get_stats())])
        self.record(["kv_events", _to_builtins(self.core.take_kv_events())])

    def flush_events(self) -> None:
        for event in self.events:
            self.record(["op", event])
        self.events.clear()


def record_mode(mode: str, seeds: range) -> Iterator[bytes]:
    """The recording of one mode, one JSON line at a time."""
    lines: list[bytes] = []

    def emit(event: list) -> None:
        lines.append(_json(event) + b"\n")

    with ledger_calls_recorded(emit):
        for seed, (policy, chunked, threshold, prefix_caching) in itertools.product(seeds, VARIANTS):
            wl = make_workload(seed, threshold, policy, chunked)
            emit(["workload", seed, policy, chunked, threshold, prefix_caching])
            side = RecordingSide(wl, mode == "async", prefix_caching, emit)
            replay(wl, side)
            side.flush_events()
            yield from lines
            lines.clear()


def compare(lines: Iterator[bytes], path: Path) -> str | None:
    """None, or where the new recording first departs from the one kept at path."""
    workload = b""
    with path.open("rb") as kept:
        for number, (new, old) in enumerate(itertools.zip_longest(lines, kept), 1):
            if new == old:
                workload = new if new.startswith(b'["workload"') else workload
                continue
            return (f"{path.name} line {number} (in {workload.decode().strip()}):\n"
                    f"  kept: {(old or b'(end)').decode()[:2000].strip()}\n  now:  {(new or b'(end)').decode()[:2000].strip()}")
    return None


def run_mode(mode: str, seeds: range, out: Path | None, kept: Path | None) -> tuple[str, str | None]:
    """Record one mode, writing it to out or comparing it with the one kept; its sha256 and where it differs."""
    digest = hashlib.sha256()
    where = None
    with closing(record_mode(mode, seeds)) as recording:
        lines = _hashed(recording, digest)
        if kept is not None:
            where = compare(lines, kept / f"{mode}.jsonl")
        elif out is not None:
            with (out / f"{mode}.jsonl").open("wb") as f:
                f.writelines(lines)
        else:
            for _ in lines:
                pass
    return digest.hexdigest(), where


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where_to = p.add_mutually_exclusive_group()
    where_to.add_argument("--out", type=Path, help="write the recordings and their hashes to this folder")
    where_to.add_argument("--compare", type=Path, help="compare with the recordings --out wrote to this folder")
    p.add_argument("--seeds", type=int, default=20, help=f"seeds per mode, each in {len(VARIANTS)} variants")
    args = p.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    hashes, differ = [], []
    for mode in MODES:
        sha, where = run_mode(mode, range(args.seeds), args.out, args.compare)
        hashes.append(f"{mode} {sha}")
        print(hashes[-1] if where is None else f"{mode} differs", flush=True)
        if where is not None:
            differ.append(where)
    if args.out:
        (args.out / "sha256.txt").write_text("\n".join(hashes) + "\n")
    if differ:
        print(*differ, sep="\n")
    elif args.compare:
        print(f"identical to {args.compare}")
    return 1 if differ else 0


def _hashed(lines: Iterator[bytes], digest: "hashlib._Hash") -> Iterator[bytes]:
    for line in lines:
        digest.update(line)
        yield line


if __name__ == "__main__":
    sys.exit(main())
