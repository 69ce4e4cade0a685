"""Prometheus metrics of the engine core, named after vLLM's where the meaning is the same."""

import time
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from protocol import EngineCoreOutput, SchedulerStats

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)


class EngineMetrics:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.registry = r = CollectorRegistry()
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
        self._arrival: dict[str, float] = {}
        self._last_token: dict[str, float] = {}
        self.server: WSGIServer | None = None

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()

    def update_stats(self, stats: SchedulerStats) -> None:
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.blocks_held.set(stats.num_blocks_held)
        self.blocks_cached_free.set(stats.num_cached_free_blocks)
        slots = stats.num_blocks_held * self.block_size
        self.token_occupancy.set(stats.num_tokens_stored / slots if slots else 0.0)
        last = self._last
        self.prefix_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self.prompt_tokens.inc(stats.num_prompt_tokens - last.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens - last.num_generation_tokens)
        self._last = stats

    def on_arrival(self, request_id: str) -> None:
        self._arrival[request_id] = time.monotonic()

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.monotonic()
        for out in outputs:
            if out.new_token_ids:
                last = self._last_token.get(out.request_id)
                if last is None:
                    arrival = self._arrival.get(out.request_id)
                    if arrival is not None:
                        self.ttft.observe(now - arrival)
                else:
                    self.itl.observe(now - last)
                self._last_token[out.request_id] = now
            if out.finish_reason is not None:
                self.request_success.labels(out.finish_reason).inc()
                self._arrival.pop(out.request_id, None)
                self._last_token.pop(out.request_id, None)
