"""The client-facing endpoints a server opens first: the ZeroMQ client socket and the HTTP API's port.

Both an engine core (`kvengine serve`) and a data-parallel router open them the same way, before any
model loads, so that a taken address or port is a one-line start-up error.
"""

import logging
import os
import socket
import stat
from pathlib import Path

import zmq

from engine_core.client_router import ClientRouter
from launch.api_server.launcher import ApiServers
from protocol.config import EngineConfig

logger = logging.getLogger("kvengine.serve")


def open_client_endpoints(ctx: zmq.Context, config: EngineConfig,
                          tmpdir: str) -> tuple[ClientRouter, ApiServers | None] | None:
    """The client socket on --address (default: a fresh ipc:// path in tmpdir) and, with --api-server-count,
    the HTTP API's listening socket; None after one log line if either cannot be opened."""
    server = config.server
    address = server.client_address() or f"ipc://{tmpdir}/engine.sock"
    taken = ipc_path_taken(address)
    if taken is not None:
        logger.error("Start-up failed: %s", taken)
        return None
    try:
        router = ClientRouter(ctx, address, server.max_pending_requests, server.max_client_requests)
    except zmq.ZMQError as e:
        logger.error("Start-up failed: cannot listen on %s: %s", address, e)
        return None
    if not server.api_server_count:
        return router, None
    try:
        return router, ApiServers(config)
    except OSError as e:
        logger.error("Start-up failed: cannot listen on http://%s:%d: %s", server.host, server.port, e)
        router.close()
        return None


def ipc_path_taken(address: str) -> str | None:
    """Why an ipc:// address must not be bound, or None. Binding replaces the file, which would orphan a live
    server there; a file no server answers on is stale and removed."""
    path = address.removeprefix("ipc://")
    if not address.startswith("ipc://") or path.startswith("@") or not os.path.lexists(path):
        return None  # not a file (tcp://, an abstract socket) or nothing there
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        return f"{path} exists and is not a socket"
    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(10)
        try:
            probe.connect(path)
        except FileNotFoundError:
            return None
        except ConnectionRefusedError:
            Path(path).unlink(missing_ok=True)
            logger.info("Removed a stale socket file %s (no server answered there)", path)
            return None
        except OSError as e:
            return f"cannot tell whether a server listens on {address}: {e}"
    return f"a server is already listening on {address}; stop it or choose another --address"
