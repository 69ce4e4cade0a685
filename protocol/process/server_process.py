"""The frame every kvengine server process shares: the engine core (`kvengine serve`), the data-parallel router
and a headless host. A stop signal sets `stopping` (the process's loop notices it and returns), `run` raises the
open-file limit, serves, and always closes what was opened, also on failure."""

import logging
import signal

from protocol.process.open_files import raise_open_file_limit
from protocol.process.signals import STOP_SIGNALS


class ServerProcess:
    logger = logging.getLogger("kvengine.serve")
    stop_note = "shutting down"  # what a stop signal starts, for the log line

    def __init__(self) -> None:
        self.stopping = False

    def _on_signal(self, signum: int, frame: object) -> None:
        self.logger.info("Received %s, %s", signal.Signals(signum).name, self.stop_note)
        self.stopping = True

    def run(self) -> int:
        """Serve until a stop signal or a failure; the process exit code."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        raise_open_file_limit()
        try:
            return self.serve()
        finally:
            self.close()

    def serve(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError
