"""ListenerGate: while client connections near the open-file limit, new ones wait outside.

Every client connection holds a descriptor in the server. At the limit (EMFILE) libzmq's listeners part
ways: the ipc:// one aborts the process (src/ipc_listener.cpp, accept(): EMFILE is not among the errors it
allows), the tcp:// one counts a failed accept and tries again at the next poll, a core busy until a
descriptor is free. No socket option caps a listener's connections, and unbinding one closes every
connection it accepted. So the server turns new clients away itself, before the limit: once an accepted
connection's descriptor number reaches the pause mark (descriptors are handed out lowest first, so every
lower one is taken), an ipc:// socket file is renamed away, and new clients find no server there (ZeroMQ
clients retry) while the connected ones are served; the file comes back once open descriptors fall to
seven eighths of the mark. The mark leaves SLACK descriptors (three quarters of a small limit) for the
connections accepted before the engine loop reads the event and those the kernel had queued
(ACCEPT_BACKLOG in client_router.py): a flood that outruns the loop by more can still reach the limit.
A tcp:// listener and an abstract ipc:// name have no file to hide (logged once). A flood that keeps
coming is logged at its 1st, 2nd, 4th, 8th... pause.
"""

import logging
import os
import resource
from pathlib import Path

logger = logging.getLogger(__name__)
SLACK = 2048  # descriptors above the pause mark (one local process opens some 16 000 connections a second)


def open_descriptors() -> int | None:
    """How many descriptors this process holds; None where that cannot be read (none left to read it)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir opened
    except OSError:
        return None


class ListenerGate:
    def __init__(self, address: str) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.limit = soft if soft != resource.RLIM_INFINITY else None
        self.pause_at = max(soft // 4, soft - SLACK)
        self.resume_at = self.pause_at * 7 // 8
        path = address.removeprefix("ipc://")
        self.path = Path(path) if address.startswith("ipc://") and not path.startswith("@") else None
        self.address = address
        self.hidden: Path | None = None
        self.open_estimate = 0  # while hidden: descriptors at the last count, plus accepted, less disconnected
        self.pauses = 0
        self.warned = False

    def update(self, accepted: list[int], disconnected: int) -> None:
        """After the monitor's events: descriptors of new connections, and how many connections ended."""
        if self.limit is None:
            return
        if self.hidden is not None:
            self.open_estimate += len(accepted) - disconnected
            if self.open_estimate <= self.resume_at:
                self._resume()
        elif accepted and max(accepted) >= self.pause_at:
            self._pause(max(accepted))

    def _pause(self, descriptor: int) -> None:
        if self.path is None:
            if not self.warned:
                logger.warning("Client connections hold descriptor %d of the open-file limit %d; %s has no socket "
                               "file to hide, so new clients are not turned away", descriptor, self.limit,
                               self.address)
                self.warned = True
            return
        hidden = self.path.with_name(f".{self.path.name}.hidden-{os.getpid()}")
        try:
            self.path.rename(hidden)
        except OSError as e:
            logger.error("Could not turn new clients away (renaming %s): %s", self.path, e)
            return
        self.hidden = hidden
        self.open_estimate = open_descriptors() or descriptor
        self.pauses += 1
        if self._logged():
            logger.warning("Client connections hold descriptor %d of the open-file limit %d: new clients wait (%s "
                           "hidden) until open files fall to %d (pause %d)", descriptor, self.limit, self.path,
                           self.resume_at, self.pauses)

    def _resume(self) -> None:
        assert self.path is not None and self.hidden is not None
        count = open_descriptors()
        if count is None or count > self.resume_at:
            self.open_estimate = self.pause_at if count is None else count
            return
        try:
            os.link(self.hidden, self.path)  # not a rename: that would replace whatever took the path meanwhile
        except OSError as e:  # another server took the path: this one keeps only its connected clients
            logger.error("New clients stay away: cannot put %s back: %s", self.path, e)
            self.close()
            self.path = None
            return
        self.hidden.unlink()
        self.hidden = None
        if self._logged():
            logger.info("Open files fell to %d: new clients are accepted again on %s", count, self.address)

    def _logged(self) -> bool:
        """Pauses 1, 2, 4, 8... are logged, with their resumes."""
        return self.pauses & (self.pauses - 1) == 0

    def close(self) -> None:
        """Remove the hidden file (the listener's own close removes the socket file's usual name)."""
        if self.hidden is not None:
            self.hidden.unlink(missing_ok=True)
            self.hidden = None
