"""Prometheus metrics, named like vLLM's (``vllm:`` becomes ``blink:``), with vLLM's buckets
(``vllm/v1/metrics/loggers.py``), plus Blink's own series.

- Per request, observed by the frontend as it streams (:class:`blink.dpu.generation.ChoiceRun`):
  TTFT, inter-token latency (also exported as vLLM's older ``time_per_output_token_seconds``),
  e2e latency, the per-request token counts and parameters, and the phases of a request —
  queue (written to the ring → admitted by the engine; the admission is the engine's own step
  stamp, :mod:`blink.dpu.step_clock`), prefill (admitted → first token), decode (first → last
  token), inference (admitted → last token). Each of a request's ``n`` choices runs as its own
  engine request and is counted as one.
- Scheduler state, read from :meth:`EngineClient.stats` at scrape time by a collector: running
  / waiting requests, KV-cache usage, prefix-cache and preemption counters, and Blink's own
  ``blink:engine_*`` / ``blink:ring_*`` series (steps, heartbeat age, ring slot and prompt-arena
  occupancy) where the client can tell.
- Host threads (:mod:`blink.threads.metrics`): the thread policy's per-setting status and
  per-role run-queue wait, context switches and CPU time, of the frontend and (under ``blink
  serve``) of the engine, and the engine loop's per-step run-queue wait.
- ``blink:iteration_tokens_total`` (tokens per engine step): from the (steps, tokens) the ring
  client saw between two polls; when a poll spans several steps each gets their average.

Each app has its own ``CollectorRegistry`` so that several apps (tests) can live in one process.
"""
from __future__ import annotations

from typing import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from blink.dpu.engine_client import EngineClient
from blink.threads.metrics import ThreadsCollector
from blink.threads.runtime import snapshot_sources

# vLLM's buckets for the same metrics.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
#: most per-step observations one scrape adds (a poll spanning many steps repeats its average)
_MAX_STEP_OBSERVATIONS = 100_000


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value``."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


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
        # vLLM's older name, still used by its Grafana dashboard.
        yield self._gauge("blink:gpu_cache_usage_perc",
                          "KV-cache usage. 1 means 100 percent usage. Same as "
                          "blink:kv_cache_usage_perc (vLLM's deprecated name).", s["kv_usage"])
        yield self._counter("blink:prefix_cache_queries",
                            "Prefix cache queries, in terms of number of queried tokens.",
                            s["prefix_cache_queries"])
        yield self._counter("blink:prefix_cache_hits",
                            "Prefix cache hits, in terms of number of cached tokens.",
                            s["prefix_cache_hits"])
        yield self._counter("blink:num_preemptions",
                            "Cumulative number of preemptions from the engine.", s["preemptions"])
        if "steps" in s:
            yield self._counter("blink:engine_steps",
                                "Engine steps since the engine started (rate() = steps/s).",
                                s["steps"])
        if "step_tokens" in s:
            yield self._counter("blink:engine_step_tokens",
                                "Tokens the engine steps processed (admitted prompt tokens + "
                                "generated tokens); per step: rate(this) / rate(engine_steps).",
                                s["step_tokens"])
        if "kv_transfer_bytes" in s:  # prefill engines (docs/disaggregation.md)
            yield self._counter("blink:kv_transfer_bytes",
                                "KV-cache bytes prefill engines wrote into decode engines.",
                                s["kv_transfer_bytes"])
            yield self._counter("blink:kv_transfers",
                                "Requests whose prompt KV a prefill engine sent to a decode engine.",
                                s.get("kv_transfers", 0))
        if "spec_decode_num_drafts" in s:  # --speculative-config (vLLM's names)
            yield self._counter("blink:spec_decode_num_drafts",
                                "Number of spec decoding drafts (decode rows that verified a draft).",
                                s["spec_decode_num_drafts"])
            yield self._counter("blink:spec_decode_num_draft_tokens",
                                "Number of draft tokens.", s["spec_decode_num_draft_tokens"])
            yield self._counter("blink:spec_decode_num_accepted_tokens",
                                "Number of accepted tokens.", s["spec_decode_num_accepted_tokens"])
            per_pos = CounterMetricFamily("blink:spec_decode_num_accepted_tokens_per_pos",
                                          "Accepted tokens per draft position.",
                                          labels=["model_name", "position"])
            for position, value in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos", [])):
                per_pos.add_metric([*self._labels, str(position)], value)
            yield per_pos
        if "heartbeat_age_s" in s:
            yield self._gauge("blink:engine_heartbeat_age_seconds",
                              "Seconds since the engine's heartbeat was last seen moving.",
                              s["heartbeat_age_s"])
        for key, name, doc in (
                ("slots_used", "blink:ring_slots_used", "Ring request slots holding a request."),
                ("slots_total", "blink:ring_slots_total", "Ring request slots (--max-num-seqs)."),
                ("arena_used", "blink:ring_arena_tokens_used", "Prompt-arena tokens in use."),
                ("arena_total", "blink:ring_arena_tokens_total", "Prompt-arena size in tokens."),
        ):
            if key in s:
                yield self._gauge(name, doc, s[key])  # type: ignore[literal-required]
        if "kv_blocks_total" in s:
            info = GaugeMetricFamily("blink:cache_config_info",
                                     "Information of the engine's KV cache (always 1).",
                                     labels=["model_name", "num_gpu_blocks"])
            info.add_metric([*self._labels, str(s["kv_blocks_total"])], 1)
            yield info


class FrontendMetrics:
    """The metrics of one app; ``registry`` is what ``/metrics`` exposes."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._engine = engine
        labels = ["model_name"]
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        token_buckets = build_1_2_5_buckets(engine.max_model_len)
        self.ttft = histogram("blink:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", _TTFT_BUCKETS)
        self.itl = histogram("blink:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS)
        self.tpot = histogram("blink:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (the inter-token "
                              "latency, under vLLM's older name).", _ITL_BUCKETS)
        self.request_tpot = histogram(
            "blink:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request (decode time / "
            "(generated tokens - 1)).", _ITL_BUCKETS)
        self.e2e = histogram("blink:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.",
                             _REQUEST_BUCKETS)
        self.queue_time = histogram("blink:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    _REQUEST_BUCKETS)
        self.inference_time = histogram("blink:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        _REQUEST_BUCKETS)
        self.prefill_time = histogram("blink:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.",
                                      _REQUEST_BUCKETS)
        self.decode_time = histogram("blink:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.",
                                     _REQUEST_BUCKETS)
        self.request_prompt_tokens = histogram("blink:request_prompt_tokens",
                                               "Number of prefill tokens processed.", token_buckets)
        self.request_generation_tokens = histogram("blink:request_generation_tokens",
                                                   "Number of generation tokens processed.",
                                                   token_buckets)
        self.request_max_generation_tokens = histogram(
            "blink:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", token_buckets)
        self.params_n = histogram("blink:request_params_n",
                                  "Histogram of the n request parameter.", _N_BUCKETS)
        self.params_max_tokens = histogram("blink:request_params_max_tokens",
                                           "Histogram of the max_tokens request parameter.",
                                           token_buckets)
        self.iteration_tokens = histogram("blink:iteration_tokens_total",
                                          "Histogram of number of tokens per engine_step.",
                                          _ITERATION_TOKEN_BUCKETS)
        self.prompt_tokens = counter("blink:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter("blink:prompt_tokens_cached",
                                            "Number of cached prompt tokens (prefix-cache hits).")
        self.generation_tokens = counter("blink:generation_tokens",
                                         "Number of generation tokens processed.")
        self._success = Counter("blink:request_success",
                                "Count of successfully processed requests.",
                                labels + ["finished_reason"], registry=r)
        # The HTTP server's connections (blink.dpu.http_server) and clients that leave early
        self.http_connections = Gauge("blink:http_connections",
                                      "HTTP connections open now.", registry=r)
        self.http_connections_refused = Counter(
            "blink:http_connections_refused",
            "HTTP connections refused with 503 because --max-connections were open.", registry=r)
        self.http_request_timeouts = Counter(
            "blink:http_request_timeouts",
            "HTTP requests ended with 408 because their head or body did not arrive within "
            "--http-header-timeout / --http-body-timeout.", ["phase"], registry=r)
        self.http_client_disconnects = Counter(
            "blink:http_client_disconnects",
            "HTTP clients that left before their request body was read (the request is "
            "dropped; no answer is sent).", registry=r)
        r.register(_EngineStatsCollector(engine, model_name))
        # Host threads of this process and of the engine (blink.threads.metrics)
        r.register(ThreadsCollector(snapshot_sources()))

    def request_finished(self, finish_reason: str) -> None:
        self._success.labels(self.model_name, finish_reason).inc()

    def before_scrape(self) -> None:
        """Fold what the engine client saw since the last scrape into the step histogram."""
        samples = getattr(self._engine, "step_token_samples", None)
        if samples is None:
            return
        budget = _MAX_STEP_OBSERVATIONS
        for steps, tokens in samples():
            per_step = tokens / steps
            for _ in range(min(steps, budget)):
                self.iteration_tokens.observe(per_step)
            budget -= min(steps, budget)
