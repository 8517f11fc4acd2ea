"""Prometheus metrics, named like vLLM's (``vllm:`` becomes ``blink:``).

Latency histograms and token counters are observed by the frontend as it streams; scheduler
state (running/waiting requests, KV-cache usage, prefix-cache and preemption counters) is read
from :meth:`EngineClient.stats` at scrape time by a custom collector. Each app has its own
``CollectorRegistry`` so that several apps (tests) can live in one process.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blink.dpu.engine_client import EngineClient

# vLLM's buckets for the same metrics.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineStatsCollector(Collector):
    """Gauges and counters that mirror the engine's own state at scrape time."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self._engine = engine
        self._labels = [model_name]

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=["model_name"])
        g.add_metric(self._labels, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric(self._labels, value)
        return c

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        yield self._gauge("blink:num_requests_running",
                          "Number of requests in model execution batches.", s["running"])
        yield self._gauge("blink:num_requests_waiting",
                          "Number of requests waiting to be processed.", s["waiting"])
        yield self._gauge("blink:kv_cache_usage_perc",
                          "KV-cache usage. 1 means 100 percent usage.", s["kv_usage"])
        yield self._counter("blink:prefix_cache_queries",
                            "Prefix cache queries, in terms of number of queried tokens.",
                            s["prefix_cache_queries"])
        yield self._counter("blink:prefix_cache_hits",
                            "Prefix cache hits, in terms of number of cached tokens.",
                            s["prefix_cache_hits"])
        yield self._counter("blink:num_preemptions",
                            "Cumulative number of preemptions from the engine.", s["preemptions"])


class FrontendMetrics:
    """The metrics of one app; ``registry`` is what ``/metrics`` exposes."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("blink:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", labels,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("blink:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", labels,
                             buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("blink:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", labels,
                             buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("blink:request_queue_time_seconds",
                                    "Histogram of time spent waiting in the engine queue.",
                                    labels, buckets=_REQUEST_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("blink:prompt_tokens", "Number of prefill tokens processed.",
                                     labels, registry=r).labels(model_name)
        self.generation_tokens = Counter("blink:generation_tokens",
                                         "Number of generation tokens processed.", labels,
                                         registry=r).labels(model_name)
        self._success = Counter("blink:request_success",
                                "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=r)
        r.register(_EngineStatsCollector(engine, model_name))

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
