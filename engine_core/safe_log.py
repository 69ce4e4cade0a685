"""Client-supplied values in log lines: escaped, so a newline cannot start a forged line, and cut short;
warnings about what a client sent are limited per client."""

import logging
import time
from dataclasses import dataclass


def safe_for_log(value: object, limit: int = 200) -> str:
    """repr() of value (control characters escaped), at most `limit` characters; a cut one ends in '...'."""
    if isinstance(value, str | bytes):
        value = value[: limit + 1]  # enough to show that it is cut, without a repr of all of it
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


MAX_PEERS = 1000  # clients with a warning count, before those whose period ended are forgotten


@dataclass
class _Window:
    start: float  # time.monotonic() when the client's current period began
    count: int = 0  # warnings about the client in it, logged or not


class PeerWarnings:
    """Warnings about what one client sent: at most `limit` per client per `period` seconds, so one client
    cannot flood the log; the rest are counted and reported in one line when its next period starts or it leaves."""

    def __init__(self, logger: logging.Logger, limit: int = 10, period: float = 60.0) -> None:
        self.logger, self.limit, self.period = logger, limit, period
        self.windows: dict[bytes, _Window] = {}

    def warning(self, peer: bytes, msg: str, *args: object) -> None:
        """Log msg % args, naming the client, unless this client is over its limit."""
        window = self.windows.get(peer)
        if window is None or time.monotonic() - window.start >= self.period:
            self.forget(peer)
            if len(self.windows) >= MAX_PEERS:
                self._forget_idle()
            window = self.windows[peer] = _Window(time.monotonic())
        window.count += 1
        if window.count <= self.limit:
            self.logger.warning(msg + " (client %s)", *args, client_name(peer))
        elif window.count == self.limit + 1:
            self.logger.warning("More than %d warnings about client %s in %.0f s: counting the rest",
                                self.limit, client_name(peer), self.period)

    def forget(self, peer: bytes) -> None:
        """Report what was suppressed for this client and drop its count (it left, or its period ended)."""
        window = self.windows.pop(peer, None)
        if window is not None and window.count > self.limit:
            self.logger.warning("Suppressed %d warning(s) about client %s", window.count - self.limit, client_name(peer))

    def _forget_idle(self) -> None:
        """Forget clients whose period has ended: a gone client's late messages may have made a window after it left."""
        now = time.monotonic()
        for peer in [p for p, w in self.windows.items() if now - w.start >= self.period]:
            self.forget(peer)


def client_name(identity: bytes) -> str:
    """A client's ZeroMQ identity for a log line (hex, cut short: a client may choose a long one)."""
    return identity.hex()[:16]
