"""The signals that stop a kvengine process gracefully: SIGINT, SIGTERM and SIGHUP (a closed terminal).

Servers, routers and headless hosts handle them by stopping; workers ignore them and exit when told.
"""

import signal

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
