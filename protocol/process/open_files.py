"""The open-file limit of the engine-core and worker processes.

Every client connection holds a file descriptor in the engine core, so the engine raises its soft
RLIMIT_NOFILE to the hard limit at start-up: that is how many clients it can hold. At the limit libzmq's
ipc:// listener aborts the process (its tcp:// listener survives); the client socket keeps new clients
out before it (engine_core/listener_gate.py). Raise the hard limit (ulimit -Hn, LimitNOFILE=) for more.
"""

import logging
import resource

logger = logging.getLogger(__name__)


def raise_open_file_limit() -> None:
    """Soft RLIMIT_NOFILE := hard (logged at DEBUG); a refusal is logged and start-up goes on."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        logger.warning("Could not raise the open-file limit from %d to %d: %s", soft, hard, e)
        return
    logger.debug("Open-file limit raised from %d to %d", soft, hard)
