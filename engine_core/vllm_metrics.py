"""The series a vLLM operator's tools read (Grafana dashboards, autoscalers, load generators), under vLLM's names,
labels (model_name, engine) and histogram buckets, with vLLM's meanings; exported beside kvengine's own series.

Latencies are measured in the engine core: from a request's arrival there (vLLM: its arrival in the front end,
which is earlier by the API server's tokenisation and one ZeroMQ hop) to its first token (TTFT), between two of
its outputs (inter-token latency) and to its end (end-to-end, for requests that ran: stop, length or abort).
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM v1's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class VllmMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, engine: int = 0) -> None:
        self.labels = labels = {"model_name": model_name, "engine": str(engine)}
        names = list(labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge("vllm:" + name, doc, names, registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter("vllm:" + name, doc, names, registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram("vllm:" + name, doc, names, buckets=buckets, registry=registry).labels(**labels)

        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms of number of queried "
                                      "tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*names, "finished_reason"], registry=registry)
        self.request_success = {r: success.labels(**labels, finished_reason=r) for r in FINISH_REASONS}
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
