"""A client found gone when its outputs are sent has its requests aborted, also without a monitor event.

The disconnect event names a file descriptor, and a message's SRCFD names the descriptor it came in on; one
read after its connection closed and the descriptor went to a new client maps that descriptor to the wrong
client. The send to the gone client (EHOSTUNREACH) still queues it as gone. Real sockets, one process."""

import time

import zmq

from engine_core.client_router import ClientRouter
from protocol import EngineCoreOutput, EngineCoreRequest, SamplingParams
from protocol.codec import client_codec

TRIES = 2000  # routing attempts, each after a short pause, until the ROUTER has dropped the gone client's pipe


def test_a_client_gone_without_a_monitor_event_is_queued_as_gone_when_routed_to(tmp_path):
    ctx = zmq.Context()
    router = ClientRouter(ctx, f"ipc://{tmp_path}/engine.sock")
    client = ctx.socket(zmq.DEALER)
    try:
        client.connect(f"ipc://{tmp_path}/engine.sock")
        client.send(client_codec().encode(EngineCoreRequest("r1", [1, 2, 3], SamplingParams(), time.time())))
        assert router.sock.poll(60_000)
        router.read()
        [(identity, request)] = router.take_inbox()
        assert router.admit(identity, request)
        client.close(linger=0)
        router.fd_to_client.clear()  # as when the message's descriptor had gone to another client
        for _ in range(TRIES):
            router.read()  # the disconnect event names no known client now
            router.route([EngineCoreOutput("r1", [7])])
            if router.inbox:
                break
            time.sleep(0.005)
        assert router.take_inbox() == [(identity, None)]
        assert router.drop_client(identity) == ["r1"]  # the engine loop aborts these
        assert router.drop_client(identity) == [] and not router.owners  # a second report of it aborts nothing
    finally:
        router.close()
        ctx.term()
