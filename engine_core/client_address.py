"""The client socket of a server (an engine core or the DP router), opened first, before any model loads, so that a
taken address is a one-line start-up error: --address, or a fresh ipc:// path in the server's private folder."""

import logging
import os
import socket
import stat
from pathlib import Path

import zmq

from engine_core.client_router import ClientRouter
from protocol.config import EngineConfig

logger = logging.getLogger("kvengine.serve")


def open_client_router(ctx: zmq.Context, config: EngineConfig, tmpdir: str) -> ClientRouter | None:
    """The client socket on --address (default: ipc:// in tmpdir); None after one log line if it cannot be opened."""
    server = config.server
    address = server.client_address() or f"ipc://{tmpdir}/engine.sock"
    taken = ipc_path_taken(address)
    if taken is not None:
        logger.error("Start-up failed: %s", taken)
        return None
    try:
        return ClientRouter(ctx, address, server.max_pending_requests, server.max_client_requests)
    except zmq.ZMQError as e:
        logger.error("Start-up failed: cannot listen on %s: %s", address, e)
        return None


def remove_socket_file(address: str) -> None:
    """An ipc:// address's file, once its server closed it."""
    if address.startswith("ipc://"):
        Path(address.removeprefix("ipc://")).unlink(missing_ok=True)


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
