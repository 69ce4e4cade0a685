"""EngineLoop: the engine-core process loop. Between steps it applies what clients sent; each step
it runs the engine core, routes the outputs, retries slow clients' backlogs, publishes KV events and
refreshes the stats."""

import time
from collections.abc import Callable

from engine_core.client_router import ClientRouter
from engine_core.core import EngineCore
from engine_core.kv_event_publisher import KVEventPublisher
from engine_core.metrics import EngineMetrics
from engine_core.stats_log import StatsLogger
from protocol import (
    EngineCoreAbort,
    EngineCoreGetInfo,
    EngineCoreGetStats,
    EngineCoreRequest,
    EngineCoreResetPrefixCache,
)

STATS_PERIOD = 0.25  # seconds between stats snapshots for metrics and the log line
IDLE_POLL_MS = 100
BACKLOG_RETRY_MS = 10  # idle poll while a slow client has a backlog (POLLOUT would not say which pipe has room)


class EngineLoop:
    def __init__(self, engine: EngineCore, router: ClientRouter, stats_interval: float,
                 metrics: EngineMetrics | None = None, kv_events: KVEventPublisher | None = None) -> None:
        self.engine, self.router = engine, router
        self.metrics, self.kv_events = metrics, kv_events
        self.stats_logger = StatsLogger(stats_interval)
        self.last_stats = 0.0

    def run(self, stopping: Callable[[], bool]) -> None:
        """Serve until stopping() is true."""
        while not stopping():
            if not self.engine.has_work() and not self.router.inbox:
                self.router.poll(BACKLOG_RETRY_MS if self.router.backlogs else IDLE_POLL_MS)
                self.engine.executor.check_health()  # a busy engine notices a dead worker in its step
            self.router.read()
            self.apply_inbox()
            if self.engine.has_work():
                outputs = self.engine.step().outputs
                if self.metrics is not None:
                    self.metrics.on_outputs(outputs)
                self.router.route(outputs)
            self.router.flush()
            if self.kv_events is not None:
                self.kv_events.publish(self.engine.take_kv_events())
            if time.monotonic() - self.last_stats >= STATS_PERIOD:
                self.last_stats = time.monotonic()
                stats = self.engine.get_stats()
                if self.metrics is not None:
                    self.metrics.update_stats(stats)
                    self.metrics.update_tier_stats(self.engine.get_tier_stats())
                self.stats_logger.maybe_log(stats)

    def apply_inbox(self) -> None:
        for identity, msg in self.router.take_inbox():
            if msg is None:
                self.engine.abort_requests(self.router.drop_client(identity))
            elif isinstance(msg, EngineCoreRequest):
                if self.router.admit(identity, msg):
                    if self.metrics is not None:
                        self.metrics.on_arrival(msg.request_id)
                    rejected = self.engine.add_request(msg)
                    if rejected is not None:
                        self.router.warn_rejected(identity, msg.request_id, rejected.error or "")
            elif isinstance(msg, EngineCoreAbort):
                self.engine.abort_requests([rid for rid in msg.request_ids if self.router.owns(identity, rid)])
            elif isinstance(msg, EngineCoreGetStats):
                self.router.reply(identity, [], stats=self.engine.get_stats())
            elif isinstance(msg, EngineCoreResetPrefixCache):
                self.router.reply(identity, [], reset_prefix_cache=self.engine.reset_prefix_cache())
            elif isinstance(msg, EngineCoreGetInfo):
                self.router.reply(identity, [], info=self.engine.info())
