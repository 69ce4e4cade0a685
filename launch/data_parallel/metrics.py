"""The router's /metrics: every live engine's Prometheus metrics, each sample labelled with its engine."""

import contextlib
import urllib.request
from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from launch.data_parallel.engines import EngineProcess

METRICS_FETCH_TIMEOUT = 5.0


class EngineMetricsCollector:
    """Every live engine's Prometheus metrics, fetched from its private endpoint, each sample labelled engine="i"."""

    def __init__(self, engines: list[EngineProcess]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for engine in self.engines:
            if not engine.alive or engine.metrics_port is None:
                continue
            url = f"http://127.0.0.1:{engine.metrics_port}/metrics"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=METRICS_FETCH_TIMEOUT) as response:
                    text = response.read().decode()
                for family in text_string_to_metric_families(text):
                    merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                    merged.samples += [s._replace(labels={**s.labels, "engine": str(engine.index)})
                                       for s in family.samples]
        yield from families.values()
