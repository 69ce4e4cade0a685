"""The open-file limit of the engine-core and worker processes.

Every client connection holds a file descriptor in the engine core. When none is left, libzmq's
ipc:// listener asserts on EMFILE and aborts the process (its tcp:// listener survives), so the
engine raises its soft RLIMIT_NOFILE to the hard limit at start-up. That only moves the edge: a
server whose clients exhaust the hard limit too still aborts on ipc://, which the engine cannot
prevent from outside libzmq; raise the hard limit (ulimit -Hn, LimitNOFILE=) for more clients.
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
