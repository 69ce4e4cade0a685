"""A ZeroMQ socket's monitor whose reader never blocks libzmq's I/O thread.

libzmq sends each monitor event from the I/O thread with a blocking send (src/socket_base.cpp,
monitor_event). If the reader's pipe is full, or the reader is closed while the monitor runs, that send
waits, and with it every connection of the context and the monitor lock that disable_monitor and the
socket's close take. So the reader's pipe has no high-water mark, and a monitor is stopped
(disable_monitor) before its reader closes.
"""

import uuid
from typing import TypeVar

import zmq

SocketT = TypeVar("SocketT", bound=zmq.Socket)


def monitor_socket(ctx: "zmq.Context[SocketT]", sock: zmq.Socket, events: int) -> SocketT:
    """A PAIR socket of ctx that receives sock's events (zmq.utils.monitor.recv_monitor_message reads them)."""
    endpoint = f"inproc://monitor-{uuid.uuid4().hex}"
    sock.monitor(endpoint, events)
    reader = ctx.socket(zmq.PAIR)
    reader.setsockopt(zmq.RCVHWM, 0)
    reader.setsockopt(zmq.LINGER, 0)
    reader.connect(endpoint)
    return reader
