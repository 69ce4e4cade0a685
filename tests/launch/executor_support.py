"""Scripted worker processes that the executor tests start (no tests here)."""

import textwrap

# A worker that reports its KV budget, then does what its rank's line says; it ignores SIGTERM, as workers do.
SILENT_WORKER = textwrap.dedent("""
    import signal, sys, time, msgspec, zmq
    from protocol.process.worker_config import WorkerConfig
    from protocol import FullAttentionSpec, WorkerKVReport
    from protocol.codec import worker_to_engine_codec
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cfg = msgspec.json.decode(sys.argv[1], type=WorkerConfig)
    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"rank{cfg.rank}".encode())
    sock.connect(cfg.engine_address)
    sock.send(worker_to_engine_codec().encode(
        WorkerKVReport(cfg.rank, 1 << 20, {"l0": FullAttentionSpec(16, 1, 8, 2)}, [], 64, 100)))
    RANK_ACTION
""")
