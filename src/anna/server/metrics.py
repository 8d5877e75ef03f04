"""The /metrics endpoint: engine counters in Prometheus text format, read at scrape time
(nothing is recorded on the hot path for it)."""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, InfoMetricFamily,
                                   Metric)

from anna.runtime.engine import LLMEngine
from anna.runtime.metrics import StepClass


NAMESPACES = {"anna": ("anna",), "vllm": ("vllm",), "both": ("anna", "vllm")}


class EngineCollector:
    def __init__(self, get_engine: Callable[[], LLMEngine | None], model_name: str, namespace: str = "both") -> None:
        """``namespace``: the metric name prefixes served (metrics_namespace): anna:*, vLLM's
        vllm:* (the names its Grafana dashboards and autoscalers query), or both."""
        self.get_engine = get_engine
        self.model_name = model_name
        self.prefixes = NAMESPACES[namespace]

    def collect(self) -> Iterator[Metric]:
        engine = self.get_engine()
        if engine is None:
            return
        snap = engine.snapshot()
        for prefix in self.prefixes:
            yield from self._families(prefix, engine, snap)

    def _families(self, ns: str, engine: LLMEngine, snap) -> Iterator[Metric]:
        labels = ["model_name"]
        lv = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"{ns}:{name}", doc, labels=labels)
            g.add_metric(lv, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"{ns}:{name}", doc, labels=labels)
            c.add_metric(lv, value)
            return c

        def histogram(name: str, doc: str, hist) -> HistogramMetricFamily:
            h = HistogramMetricFamily(f"{ns}:{name}", doc, labels=labels)
            h.add_metric(lv, hist.cumulative(), hist.total)
            return h

        stats = snap.stats
        yield gauge("num_requests_running", "Requests in the running batch.", snap.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", snap.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", snap.kv_usage)
        if ns == "vllm":  # the name vLLM's dashboards still query
            yield gauge("gpu_cache_usage_perc", "Fraction of KV blocks in use (1 = full); kv_cache_usage_perc's "
                        "older name.", snap.kv_usage)
        yield gauge("kv_cache_resident_bytes", "KV memory in chunks that have been used and not released.",
                    snap.kv_resident_bytes)
        yield counter("memory_releases", "Adaptive memory releases.", snap.memory_releases)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", snap.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", snap.prefix_cache_hits)
        yield counter("num_preemptions", "Requests preempted for lack of KV blocks.", snap.num_preemptions)
        yield counter("prompt_tokens", "Prompt tokens of accepted requests.", stats.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter("request_aborted", "Requests aborted (client gone or cancelled).", stats.aborted)
        fin = CounterMetricFamily(f"{ns}:request_success", "Finished requests by finish reason.",
                                  labels=labels + ["finished_reason"])
        for reason in ("stop", "length"):
            fin.add_metric(lv + [reason], stats.finished.get(reason, 0))
        yield fin
        failed = CounterMetricFamily(f"{ns}:request_failure", "Requests failed while running, by HTTP status "
                                     "(400: their input, 500: an internal error); the others went on.",
                                     labels=labels + ["status"])
        for status in ("400", "500"):
            failed.add_metric(lv + [status], stats.failed.get(int(status), 0))
        yield failed
        yield counter("engine_step_failures", "Steps that failed as a whole, failing the requests in them.",
                      stats.failed_steps)
        yield counter("prompt_cache_lookups", "Exact prompt cache lookups.", snap.prompt_cache_lookups)
        yield counter("prompt_cache_hits", "Exact prompt cache hits.", snap.prompt_cache_hits)
        steps = CounterMetricFamily(f"{ns}:engine_steps", "Engine steps by class.", labels=labels + ["step_class"])
        for cls in StepClass:
            steps.add_metric(lv + [cls.value], stats.steps.counts.get(cls, 0))
        yield steps
        spec = stats.spec
        yield counter("spec_decode_num_drafts", "Speculative decoding: sequence steps that verified proposed tokens.",
                      spec.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Speculative decoding: proposed tokens verified.",
                      spec.num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens accepted.",
                      spec.num_accepted_tokens)
        per_pos = CounterMetricFamily(f"{ns}:spec_decode_num_accepted_tokens_per_pos",
                                      "Speculative decoding: accepted tokens by position in the proposal.",
                                      labels=labels + ["position"])
        for pos, n in enumerate(spec.accepted_per_pos):
            per_pos.add_metric(lv + [str(pos)], n)
        yield per_pos
        yield counter("engine_step_spikes", "Steps longer than 3x their class's rolling mean.", stats.steps.spikes)
        for name, doc, hist in (
                ("time_to_first_token_seconds", "Arrival to first token.", stats.ttft),
                ("inter_token_latency_seconds", "Time between consecutive tokens of a request.", stats.inter_token),
                ("e2e_request_latency_seconds", "Arrival to finish.", stats.e2e),
                ("request_queue_time_seconds", "Arrival to first scheduling.", stats.queue),
                ("request_prefill_time_seconds", "First scheduling to first token.", stats.prefill),
                ("request_decode_time_seconds", "First token to finish.", stats.decode),
                ("request_prompt_tokens", "Prompt tokens of each finished sequence.", stats.request_prompt_tokens),
                ("request_generation_tokens", "Tokens each finished sequence generated.",
                 stats.request_generation_tokens),
                ("request_max_num_generation_tokens", "The most tokens one sample of each finished request generated.",
                 stats.request_max_generation_tokens),
                ("iteration_tokens_total", "Tokens each engine step computed.", stats.iteration_tokens)):
            yield histogram(name, doc, hist)
        if ns == "vllm":  # the name vLLM's dashboards still query for inter_token_latency_seconds
            yield histogram("time_per_output_token_seconds", "Time between consecutive tokens of a request.",
                            stats.inter_token)
        info = InfoMetricFamily(f"{ns}:cache_config", "Resolved cache and scheduler settings.")
        s = engine.settings
        info.add_metric([], {k: str(v) for k, v in {
            "model_name": self.model_name, "block_size": s.block_size, "num_blocks": snap.num_blocks,
            "enable_prefix_caching": s.enable_prefix_caching, "prompt_cache_size": snap.prompt_cache_size,
            "prompt_cache_max_tokens": snap.prompt_cache_max_tokens, "scheduler_profile": s.scheduler_profile,
            "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
            "long_prefill_token_threshold": s.long_prefill_token_threshold,
            "prefill_interval_steps": s.prefill_interval_steps, "quantization": s.quantization}.items()})
        yield info


def make_registry(collector: EngineCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
