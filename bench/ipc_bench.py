"""Engine-core step overhead across processes with an instant model: scheduling, msgspec and ZeroMQ only.

The workers here run the real worker socket protocol but execute each SchedulerOutput with the
model-free ReferenceExecutor. Each configuration is compared, in the same run, with a bare ZeroMQ
round trip of the same bytes (the encoded SchedulerOutput to every rank, the ModelRunnerOutput back).
Beside the wall time of a step it prints the CPU time the engine-core thread and rank 0's worker
spent on it (less moved by other processes on a shared machine), and with --breakdown the parts
of one step in one process: schedule(), the executor, update_from_output() and the msgspec codecs.
With --async-scheduling each configuration also runs with step N+1 sent before step N is applied
(interleaved with the synchronous run), so the engine core's work overlaps the workers'.

    python -m bench.ipc_bench [--running 256] [--steps 300] [--tp 1 2 4] [--breakdown] [--async-scheduling]
"""

import argparse
import os
import statistics
import sys
import tempfile

import msgspec
import zmq

from bench.timing import CallTimes, interleaved
from engine_core.core import EngineCore
from engine_core.executor.multiproc_executor import MultiprocExecutor
from engine_core.executor.reference_executor import ReferenceExecutor
from protocol import (
    EngineCoreRequest,
    FullAttentionSpec,
    InitKVCache,
    SamplingParams,
    SchedulerOutput,
    Shutdown,
    WorkerReady,
)
from protocol.codec import engine_to_worker_codec, worker_to_engine_codec
from protocol.config import engine_config
from protocol.process.worker_config import WorkerConfig, worker_configs

SPEC = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2)
WORKER_CPU_FILE = "IPC_BENCH_WORKER_CPU"  # environment: where rank 0 writes its CPU microseconds per step


def instant_worker(config: WorkerConfig) -> None:
    """A worker process whose 'model' is the ReferenceExecutor: same sockets, same messages."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{config.rank}".encode())
    sock.connect(config.engine_address)
    to_engine, from_engine = worker_to_engine_codec(), engine_to_worker_codec()
    executor = ReferenceExecutor(available_kv_bytes=[config.engine.kv_cache_memory_bytes_of(config.rank)], kv_cache_specs={"l0": SPEC})
    report = executor.determine_available_memory()[0]
    sock.send(to_engine.encode(msgspec.structs.replace(report, rank=config.rank)))

    def handle(frame: bytes) -> object:
        msg = from_engine.decode(frame)
        if isinstance(msg, SchedulerOutput):
            out = executor.execute_model(msg)
            if config.rank == 0:
                sock.send(to_engine.encode(out))
        return msg

    timed, steps = CallTimes(handle, cpu=True), []
    while True:
        msg = timed(sock.recv())
        steps.append(isinstance(msg, SchedulerOutput))
        if isinstance(msg, InitKVCache):
            executor.initialize_kv_cache(msg.kv_cache_config)
            sock.send(to_engine.encode(WorkerReady(config.rank, msg.kv_cache_config.num_blocks)))
        elif isinstance(msg, Shutdown):
            break
    cpu_us = [cpu * 1e6 for cpu, step in zip(timed.cpu, steps, strict=True) if step]
    if config.rank == 0 and os.environ.get(WORKER_CPU_FILE):
        with open(os.environ[WORKER_CPU_FILE], "wb") as f:
            f.write(msgspec.msgpack.encode(cpu_us))
    sock.close()
    ctx.term()


def decoding_core(config, executor, running: int, steps: int) -> EngineCore:
    """An EngineCore with `running` requests of 200-token prompts, all prefilled and decoding."""
    core = EngineCore(config, executor)
    params = SamplingParams(max_tokens=steps + 200, temperature=0.0, ignore_eos=True)
    for i in range(running):
        core.add_request(EngineCoreRequest(f"r{i}", [(i * 7 + j) % 1000 for j in range(200)], params, 0.0))
    while core.scheduler.waiting or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        core.step()  # prefill everything first: only decode steps are timed
    return core


def bench_config(tp: int, running: int, async_scheduling: bool = False):
    blocks = running * 80
    return engine_config(max_model_len=4096, max_num_seqs=running, max_num_batched_tokens=8192,
                         tensor_parallel_size=tp, kv_cache_memory_bytes=[blocks * SPEC.page_size_bytes],
                         async_scheduling=async_scheduling)


def engine_steps(tp: int, running: int, steps: int, tmpdir: str,
                 async_scheduling: bool) -> tuple[list[float], list[float], list[float], int, int]:
    """Per EngineCore.step() with `running` requests decoding: wall and engine-thread CPU microseconds,
    rank 0's worker CPU microseconds; also message sizes (0 with async scheduling: a step by hand would
    cut in between the steps in flight)."""
    ctx = zmq.Context()
    address = f"ipc://{tmpdir}/workers-{tp}.sock"
    config = bench_config(tp, running, async_scheduling)
    configs = worker_configs(config, address, "")
    worker_cpu_file = os.path.join(tmpdir, f"worker-cpu-{tp}")
    os.environ[WORKER_CPU_FILE] = worker_cpu_file
    executor = MultiprocExecutor(ctx, address, configs, entry=(sys.executable, "-m", "bench.ipc_bench", "--worker"))
    core = decoding_core(config, executor, running, steps)
    so_bytes = out_bytes = 0
    if not async_scheduling:
        so = core.scheduler.schedule()  # one decode step by hand, to learn the message sizes
        out = executor.execute_model(so)
        core.scheduler.update_from_output(so, out)
        so_bytes = len(engine_to_worker_codec().encode(so))
        out_bytes = len(worker_to_engine_codec().encode(out))
    step = CallTimes(core.step, cpu=True)
    for _ in range(steps):
        step()
    executor.shutdown()
    ctx.term()
    with open(worker_cpu_file, "rb") as f:
        worker_cpu = msgspec.msgpack.decode(f.read())[-steps:]
    return [w * 1e6 for w in step.wall], [c * 1e6 for c in step.cpu], worker_cpu, so_bytes, out_bytes


def breakdown(running: int, steps: int) -> None:
    """One process, no sockets: CPU microseconds of each part of a decode step (medians)."""
    config = bench_config(1, running)
    executor = ReferenceExecutor(available_kv_bytes=config.cache.kv_cache_memory_bytes, kv_cache_specs={"l0": SPEC})
    core = decoding_core(config, executor, running, steps)
    to_worker, to_engine = engine_to_worker_codec(), worker_to_engine_codec()
    parts = {name: CallTimes(fn, cpu=True) for name, fn in (
        ("schedule()", core.scheduler.schedule), ("encode SchedulerOutput", to_worker.encode),
        ("decode SchedulerOutput", to_worker.decode), ("ReferenceExecutor.execute_model", executor.execute_model),
        ("encode ModelRunnerOutput", to_engine.encode), ("decode ModelRunnerOutput", to_engine.decode),
        ("update_from_output()", core.scheduler.update_from_output))}
    schedule, encode_so, decode_so, execute, encode_out, decode_out, update = parts.values()
    for _ in range(steps):
        so = schedule()
        out = decode_out(encode_out(execute(decode_so(encode_so(so)))))
        update(so, out)
    cpu_us = {name: [c * 1e6 for c in part.cpu] for name, part in parts.items()}
    print(f"\none decode step in one process, {running} running, CPU us (medians of {steps} steps)")
    for name, times in cpu_us.items():
        print(f"  {name:<34} {statistics.median(times):>7.0f}")
    print(f"  {'sum':<34} {sum(statistics.median(t) for t in cpu_us.values()):>7.0f}")


def echo_peer(address: str, rank: int, reply_bytes: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{rank}".encode())
    sock.connect(address)
    sock.send(b"hello")
    reply = b"x" * reply_bytes
    while sock.recv() != b"stop":
        if rank == 0:
            sock.send(reply)
    sock.close()
    ctx.term()


def bare_round_trips(tp: int, so_bytes: int, out_bytes: int, steps: int, tmpdir: str) -> list[float]:
    """The same bytes over the same socket types, with nothing else done."""
    import multiprocessing as mp

    ctx = zmq.Context()
    address = f"ipc://{tmpdir}/bare-{tp}.sock"
    router = ctx.socket(zmq.ROUTER)
    router.bind(address)
    procs = [mp.get_context("spawn").Process(target=echo_peer, args=(address, r, out_bytes)) for r in range(tp)]
    for p in procs:
        p.start()
    for _ in range(tp):
        router.recv_multipart()
    payload = b"y" * so_bytes

    def round_trip() -> None:
        for r in range(tp):
            router.send_multipart([f"rank{r}".encode(), payload])
        router.recv_multipart()

    timed = CallTimes(round_trip)
    for _ in range(steps):
        timed()
    for r in range(tp):
        router.send_multipart([f"rank{r}".encode(), b"stop"])
    for p in procs:
        p.join()
    router.close()
    ctx.term()
    return [w * 1e6 for w in timed.wall]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        instant_worker(msgspec.json.decode(sys.argv[2], type=WorkerConfig))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--breakdown", action="store_true", help="also time each part of a step in one process")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also run each configuration with async scheduling (right after the synchronous run)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat every row this many times, interleaved")
    args = parser.parse_args()
    print(f"engine-core step with an instant model, {args.running} running requests decoding, "
          f"{args.steps} steps per row (medians; mean in brackets; CPU: engine-core thread, rank 0 worker)")
    print(f"{'TP':>3} {'mode':>5} {'step us':>16} {'engine CPU':>10} {'worker CPU':>10} {'bare zmq us':>16} {'ratio':>6} "
          f"{'SchedulerOutput':>16} {'output':>8}")
    modes = (False, True) if args.async_scheduling else (False,)
    sizes: dict[int, tuple[int, int]] = {}  # TP -> message sizes of its synchronous run (the async one has none)

    def row(tp: int, async_scheduling: bool, tmpdir: str):
        def run(_round: int) -> str:
            times, cpu, worker_cpu, *msg_sizes = engine_steps(tp, args.running, args.steps, tmpdir, async_scheduling)
            if not async_scheduling:
                sizes[tp] = (msg_sizes[0], msg_sizes[1])
            so_bytes, out_bytes = sizes[tp]
            bare = bare_round_trips(tp, so_bytes, out_bytes, args.steps, tmpdir)
            step, rt = statistics.median(times), statistics.median(bare)
            return (f"{tp:>3} {'async' if async_scheduling else 'sync':>5} {step:>8.0f} [{statistics.mean(times):>5.0f}] "
                    f"{statistics.median(cpu):>10.0f} {statistics.median(worker_cpu):>10.0f} {rt:>8.0f} "
                    f"[{statistics.mean(bare):>5.0f}] {step / rt:>6.1f} {so_bytes:>14} B {out_bytes:>6} B")
        return run

    with tempfile.TemporaryDirectory() as tmpdir:
        rows = {f"{tp} {mode}": row(tp, mode, tmpdir) for tp in args.tp for mode in modes}
        interleaved(rows, args.rounds, rotate=False, on_result=lambda _round, _name, line: print(line, flush=True))
    if args.breakdown:
        breakdown(args.running, args.steps)


if __name__ == "__main__":
    main()
