"""SIGINT and SIGTERM for the commands that run in the foreground with no server of their own (events, simulate).

Python turns SIGINT into KeyboardInterrupt only in a process that started with SIGINT at its default; one started
in the background of a script (`kvengine events ... &`, or by a launcher that ignores SIGINT as nohup-style
wrappers do) inherits it ignored, and no SIGINT could stop it. SIGTERM ended such a command without a word.
"""

import signal

from launch.commands.local_server import Interrupted


def raise_on_stop_signals() -> None:
    """From now on SIGINT and SIGTERM raise Interrupted (exit code 130 / 143) in the main thread, whatever the
    parent left them at."""

    def stop(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
