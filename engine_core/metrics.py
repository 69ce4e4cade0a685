"""Prometheus metrics of the engine core and their endpoint: kvengine's own series (kvengine:*, named after vLLM's
where the meaning is the same) and, beside them, vLLM's under its names, labels and buckets (vllm_metrics.py)."""

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from engine_core.kv_connector.metrics import KVTierMetrics
from engine_core.safe_log import safe_for_log
from engine_core.spec_decode.metrics import SpecDecodeMetrics
from engine_core.vllm_metrics import VllmMetrics
from protocol import EngineCoreOutput, SchedulerStats
from protocol.kv_transfer import KVTierStats

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0  # seconds a connection has to send its request and take the answer
MAX_CONNECTIONS = 64  # a new connection beyond this many drops the oldest
MAX_HEAD_BYTES = 16384  # request line and headers
BAD_REQUEST: tuple[str, list[tuple[str, str]], bytes] = ("400 Bad Request", [], b"# HTTP 400: no request line\n")
SERVER_ERROR: tuple[str, list[tuple[str, str]], bytes] = ("500 Internal Server Error", [],
                                                          b"# HTTP 500: the metrics could not be rendered\n")
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, block_size: int, model_name: str = "tiny") -> None:
        """model_name: the served model's name, vLLM's model_name label."""
        self.block_size = block_size
        self.registry = r = CollectorRegistry()
        self.vllm = VllmMetrics(r, model_name)
        p = "kvengine:"
        self.kv_cache_usage = Gauge(p + "kv_cache_usage_perc", "KV-cache usage: share of usable blocks not in the "
                                    "free queue (0-1; cached-but-free blocks count as free)", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting (new or preempted)", registry=r)
        self.blocks_held = Gauge(p + "kv_cache_blocks_held", "KV blocks referenced by running requests", registry=r)
        self.blocks_cached_free = Gauge(p + "kv_cache_blocks_cached_free",
                                        "Free KV blocks that still hold a cached prefix (evictable)", registry=r)
        self.token_occupancy = Gauge(p + "kv_cache_token_occupancy_perc",
                                     "Tokens stored / token slots of the blocks held by running requests (0-1)",
                                     registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Prefix-cache queries, in tokens", registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Prefix-cache hits, in tokens", registry=r)
        self.preemptions = Counter(p + "num_preemptions", "Preemptions (recompute)", registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens of requests that finished prefill", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.request_success = Counter(p + "request_success", "Finished requests by finish reason",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival at the engine core to the "
                              "first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between two outputs of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self._last = SchedulerStats()
        self.tiers: KVTierMetrics | None = None  # made with the first second tier's stats: no tier, no series
        self.spec: SpecDecodeMetrics | None = None  # likewise, with the first stats of --speculative-config
        self._arrival: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        self.server: MetricsServer | None = None

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        self.server = MetricsServer(self.registry, host, port)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def update_stats(self, stats: SchedulerStats) -> None:
        vllm = self.vllm
        for ours, theirs, value in ((self.kv_cache_usage, vllm.kv_cache_usage, stats.kv_cache_usage),
                                    (self.running, vllm.running, stats.num_running_reqs),
                                    (self.waiting, vllm.waiting, stats.num_waiting_reqs)):
            ours.set(value)
            theirs.set(value)
        self.blocks_held.set(stats.num_blocks_held)
        self.blocks_cached_free.set(stats.num_cached_free_blocks)
        slots = stats.num_blocks_held * self.block_size
        self.token_occupancy.set(stats.num_tokens_stored / slots if slots else 0.0)
        last = self._last
        for counter, vllm_counter, delta in (
            (self.prefix_queries, vllm.prefix_queries, stats.prefix_cache_queries - last.prefix_cache_queries),
            (self.prefix_hits, vllm.prefix_hits, stats.prefix_cache_hits - last.prefix_cache_hits),
            (self.preemptions, vllm.preemptions, stats.num_preemptions - last.num_preemptions),
            (self.prompt_tokens, vllm.prompt_tokens, stats.num_prompt_tokens - last.num_prompt_tokens),
            (self.generation_tokens, vllm.generation_tokens, stats.num_generation_tokens - last.num_generation_tokens),
        ):
            counter.inc(delta)
            vllm_counter.inc(delta)
        if self.spec is None and stats.spec_decode_num_accepted_tokens_per_pos:
            self.spec = SpecDecodeMetrics(self.registry, self.vllm.labels, len(stats.spec_decode_num_accepted_tokens_per_pos))
        if self.spec is not None:
            self.spec.update(stats, last)
        self._last = stats

    def update_tier_stats(self, tiers: list[KVTierStats]) -> None:
        """The second KV tiers' totals (engine_core/kv_connector/metrics.py)."""
        if tiers and self.tiers is None:
            self.tiers = KVTierMetrics(self.registry)
        if self.tiers is not None:
            self.tiers.update(tiers)

    def on_arrival(self, request_id: str) -> None:
        self._arrival[request_id] = time.monotonic()

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.monotonic()
        vllm = self.vllm
        for out in outputs:
            if out.new_token_ids:
                last = self._last_token.get(out.request_id)
                if last is None:
                    arrival = self._arrival.get(out.request_id)
                    if arrival is not None:
                        self.ttft.observe(now - arrival)
                        vllm.ttft.observe(now - arrival)
                else:
                    self.itl.observe(now - last)
                    vllm.itl.observe(now - last)
                self._last_token[out.request_id] = now
            if out.finish_reason is not None:
                self.request_success.labels(out.finish_reason).inc()
                vllm.request_success[out.finish_reason].inc()
                arrival = self._arrival.pop(out.request_id, None)
                if arrival is not None and out.finish_reason != "error":  # a refused request never ran
                    vllm.e2e.observe(now - arrival)
                self._last_token.pop(out.request_id, None)


class MetricsServer:
    """HTTP for prometheus_client's WSGI app, served by one asyncio loop in one thread.

    Idle or slow connections cost no thread: each has REQUEST_TIMEOUT for its whole exchange, and once
    max_connections are open a new one drops the oldest, so a scraper always gets through."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, timeout: float = REQUEST_TIMEOUT,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.app = make_wsgi_app(registry)
        self.timeout, self.max_connections = timeout, max_connections
        self.connections: dict[asyncio.StreamWriter, asyncio.Task] = {}  # oldest first
        self.loop = asyncio.new_event_loop()
        try:
            self.server = self.loop.run_until_complete(
                asyncio.start_server(self._serve, host, port, limit=MAX_HEAD_BYTES))
        except OSError:
            self.loop.close()
            raise
        self.port: int = self.server.sockets[0].getsockname()[1]
        self.thread = threading.Thread(target=self.loop.run_forever, name="metrics-http", daemon=True)
        self.thread.start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    async def _stop(self) -> None:
        self.server.close()
        tasks = list(self.connections.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self.connections) >= self.max_connections:
            self.connections.pop(next(iter(self.connections))).cancel()
        self.connections[writer] = task
        try:
            await asyncio.wait_for(self._exchange(reader, writer), self.timeout)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # too slow, gone, or a head over MAX_HEAD_BYTES: the connection just closes
        finally:
            self.connections.pop(writer, None)
            writer.close()

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request, *lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        parts = request.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            status, headers, body = BAD_REQUEST
        else:
            url = urlsplit(parts[1])
            environ = {"REQUEST_METHOD": parts[0], "PATH_INFO": url.path, "QUERY_STRING": url.query}
            for line in lines:
                name, _, value = line.partition(":")
                if name:
                    environ["HTTP_" + name.strip().upper().replace("-", "_")] = value.strip()
            try:
                status, headers, body = call_wsgi(self.app, environ)
            except Exception as e:  # noqa: BLE001 -- prometheus_client raises on some headers (Accept: x; version=abc)
                logger.warning("Metrics request failed: %s", safe_for_log(f"{type(e).__name__}: {e}"))
                status, headers, body = SERVER_ERROR
        head = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers), f"Content-Length: {len(body)}",
                "Connection: close", "", ""]
        writer.write("\r\n".join(head).encode("latin-1") + body)
        await writer.drain()


def call_wsgi(app: Callable[..., Iterable[bytes]], environ: dict[str, str]) -> tuple[str, list[tuple[str, str]], bytes]:
    """(status, headers, body) of one WSGI call."""
    started: list[tuple[str, list[tuple[str, str]]]] = []
    body = b"".join(app(environ, lambda status, headers: started.append((status, headers))))
    return started[0][0], started[0][1], body
