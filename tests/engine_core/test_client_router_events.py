"""ClientRouter's connection events never stall libzmq's I/O thread, which also carries the worker link.

libzmq sends each monitor event from the I/O thread with a blocking send. With a bounded pipe to the reader,
connections that came and went while the engine loop was in a step (it reads events between steps) filled
the pipe, and the I/O thread stopped moving every socket of the context: the step waited on workers whose
outputs could not arrive. Real sockets, one process: the engine loop's part is played by not reading.
"""

import socket

import zmq

from engine_core.client_router import ClientRouter

CHURN = 5000  # connections opened and closed: more than the 2000 events the bounded pipe held
LIVENESS_MS = 60_000  # a bound for a message that should arrive at once, not a timing


def churn(path: str) -> int:
    """Open and close CHURN connections (one the accept queue has no room for is tried again); how many."""
    made = 0
    for _ in range(100 * CHURN):  # a bound on the tries, for a listener that stopped accepting
        if made == CHURN:
            break
        with socket.socket(socket.AF_UNIX) as sock:
            sock.setblocking(False)
            try:
                sock.connect(path)
            except BlockingIOError:
                continue
            made += 1
    return made


def test_connections_that_come_and_go_unread_do_not_stall_the_worker_link(tmp_path):
    ctx, worker_ctx = zmq.Context(), zmq.Context()
    router = ClientRouter(ctx, f"ipc://{tmp_path}/engine.sock")
    link = ctx.socket(zmq.ROUTER)  # the engine core's worker socket, in the same context
    link.bind(f"ipc://{tmp_path}/workers.sock")
    worker = worker_ctx.socket(zmq.DEALER)
    worker.connect(f"ipc://{tmp_path}/workers.sock")
    try:
        made = churn(f"{tmp_path}/engine.sock")
        worker.send(b"step output")
        arrived = link.poll(LIVENESS_MS)
    finally:
        router.read()  # drains the events (the old bounded pipe then lets the I/O thread go on)
        router.close()
        for sock in (link, worker):
            sock.close(linger=0)
        ctx.term()
        worker_ctx.term()
    assert arrived, "the worker's message never arrived: the I/O thread is blocked on a monitor event"
    assert made == CHURN  # the listener went on accepting too
