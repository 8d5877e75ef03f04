"""The /metrics endpoint: engine counters in Prometheus text format, read at scrape time
(nothing is recorded on the hot path for it)."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from anna.runtime.engine import LLMEngine


class EngineCollector:
    def __init__(self, get_engine: Callable[[], LLMEngine | None], model_name: str) -> None:
        self.get_engine = get_engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        engine = self.get_engine()
        if engine is None:
            return
        labels = ["model_name"]
        lv = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"anna:{name}", doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"anna:{name}", doc, labels=labels)
            c.add_metric(lv, value)
            return c

        sched, kv, stats = engine.scheduler, engine.kv, engine.stats
        yield gauge("num_requests_running", "Requests in the running batch.", len(sched.running))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", len(sched.waiting))
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", kv.usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", kv.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", kv.prefix_cache_hits)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.", sched.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens of accepted requests.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("request_aborted", "Requests aborted (client gone or cancelled).", stats.aborted)
        fin = CounterMetricFamily("anna:request_success", "Finished requests by finish reason.",
                                  labels=labels + ["finished_reason"])
        for reason in ("stop", "length"):
            fin.add_metric(lv + [reason], stats.finished.get(reason, 0))
        yield fin


def make_registry(collector: EngineCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
