"""Entry point of one worker process: `python -m worker.main '<WorkerConfig as JSON>'`.

The worker talks to the engine core over one DEALER socket (ipc://, or tcp:// to the head on several
hosts): it reports its KV budget, allocates the cache when told the final block count, then executes
every SchedulerOutput in order. Rank 0 answers each step; any rank reports an error before it exits.
"""

import functools
import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING

import msgspec
import zmq

from protocol import GrammarOutput, InitKVCache, ProtocolError, SchedulerOutput, Shutdown, WorkerError
from protocol.codec import Codec, engine_to_worker_codec, worker_to_engine_codec
from protocol.process.hosts import pin_collective_interface
from protocol.process.open_files import raise_open_file_limit
from protocol.process.signals import STOP_SIGNALS
from protocol.process.worker_config import WorkerConfig

if TYPE_CHECKING:
    from worker.cpu_threads import ThreadGovernor
    from worker.worker import Worker

logger = logging.getLogger("kvengine.worker")
PARENT_CHECK_MS = 500


def main() -> int:
    config = msgspec.json.decode(sys.argv[1], type=WorkerConfig)
    logging.basicConfig(level=config.engine.server.log_level, format=f"%(asctime)s %(levelname)s [rank {config.rank}] %(message)s")
    for signum in STOP_SIGNALS:
        # Ctrl-C, a closed terminal or a container stop reaches the whole group: the engine core decides,
        # then sends Shutdown; a worker whose engine core is gone exits by itself (the parent check below).
        signal.signal(signum, signal.SIG_IGN)
    raise_open_file_limit()
    parent = os.getppid()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{config.rank}".encode())
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(config.engine_address)
    to_engine = worker_to_engine_codec()
    worker = None
    try:
        worker, governor = start_worker(config, parent)
        sock.send(to_engine.encode(msgspec.structs.replace(worker.report_kv(), host=config.host)))
        return serve(worker, config.rank, sock, parent, governor)
    except Exception as e:  # noqa: BLE001 -- any failure is reported to the engine core before exiting
        logger.error("Worker failed: %s", e)
        sock.send(to_engine.encode(WorkerError(config.rank, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        return 1
    finally:
        if worker is not None:
            worker.shutdown()
        sock.close()
        ctx.term()


def start_worker(config: WorkerConfig, parent: int) -> tuple["Worker", "ThreadGovernor | None"]:
    """Pin the cores and the collective interface, and ask for huge pages, before torch starts (its threads inherit
    the mask). The governor's first reading spans the model load, so the first step already runs on the threads the
    cores allow."""
    if config.cpu_cores is not None:
        os.sched_setaffinity(0, config.cpu_cores)
    if config.engine.parallel.nnodes > 1:
        pin_collective_interface(config.engine.parallel.master_addr)
    ask_for_huge_pages(config.engine.parallel.device)
    import torch

    torch.set_num_threads(config.torch_threads)
    governor = thread_governor(config, parent)
    from worker.worker import Worker

    worker = Worker(config.engine, config.rank, config.dist_init_method)
    if config.engine.parallel.device == "cpu":
        from worker.cpu_malloc import keep_freed_memory

        keep_freed_memory()  # after the load, so that what loading freed goes back to the OS
    return worker, governor


def ask_for_huge_pages(device: str) -> None:
    """On CPU, torch's allocations of 2 MiB and more on transparent huge pages where the kernel's THP mode allows
    (a decode step reads every weight, and on 4 KiB pages pays a TLB miss per page); torch reads the variable once,
    so before its first allocation. THP_MEM_ALLOC_ENABLE=0 in the environment keeps 4 KiB pages."""
    if device == "cpu":
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def thread_governor(config: WorkerConfig, parent: int) -> "ThreadGovernor | None":
    if not config.adapt_threads:
        return None
    from worker.cpu_threads import ThreadGovernor

    return ThreadGovernor(config.cpu_cores or sorted(os.sched_getaffinity(0)), parent)


def serve(worker: "Worker", rank: int, sock: zmq.Socket, parent: int, governor: "ThreadGovernor | None" = None) -> int:
    """Execute the engine core's messages in order until Shutdown (0) or the engine core is gone (1); the governor
    sets the torch threads between steps."""
    to_engine, from_engine = worker_to_engine_codec(), engine_to_worker_codec()
    while True:
        if not sock.poll(PARENT_CHECK_MS):
            if os.getppid() != parent:
                logger.error("The engine core is gone; exiting")
                return 1
            continue
        try:
            msg = from_engine.decode(sock.recv())
        except ProtocolError as e:
            logger.error("Dropped a malformed message: %s", e)
            continue
        if isinstance(msg, SchedulerOutput):
            if governor is not None:
                governor.tick()
            output = worker.execute_model(msg, functools.partial(next_grammar, sock, from_engine, msg.step, parent))
            if rank == 0:
                sock.send(to_engine.encode(output))
        elif isinstance(msg, GrammarOutput):
            raise TypeError(f"a bitmask for step {msg.step}, whose constrained requests this rank does not sample")
        elif isinstance(msg, InitKVCache):
            sock.send(to_engine.encode(worker.init_kv_cache(msg.kv_cache_config)))
        elif isinstance(msg, Shutdown):
            return 0


def next_grammar(sock: zmq.Socket, from_engine: Codec, step: int, parent: int) -> GrammarOutput:
    """Rank 0, sampling a step with constrained requests: the step's bitmask, the next message the engine core
    sends (with async scheduling it comes once the previous step's output is applied)."""
    while not sock.poll(PARENT_CHECK_MS):
        if os.getppid() != parent:
            raise RuntimeError(f"the engine core is gone while step {step} waits for its bitmask")
    msg = from_engine.decode(sock.recv())
    if not isinstance(msg, GrammarOutput) or msg.step != step:
        raise RuntimeError(f"step {step} waits for its bitmask, and the engine core sent {msg!r:.200}")
    return msg


if __name__ == "__main__":
    sys.exit(main())
