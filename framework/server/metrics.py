"""Prometheus metrics (prometheus-client), one registry per app.

Engine counters (running / waiting requests, KV-cache usage, prefix-cache queries and hits,
prompt / generation tokens, preemptions) are read from the engine process at scrape time, the
engine restarts from the API process's supervisor;
latency histograms (TTFT, inter-token, end-to-end) are observed in the API process.

fw's names follow vLLM's with the ``fw:`` prefix; with ``vllm_names`` (``fw serve --vllm-metrics``)
every metric is exported a second time under its ``vllm:`` name (plus the names of vLLM's older
dashboards, ``vllm:gpu_cache_usage_perc`` and ``vllm:time_per_output_token_seconds``), so
Grafana dashboards made for vLLM work unchanged. :func:`stats_line` is the periodic log line.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from framework.engine.outputs import EngineStats

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class _EngineCollector:
    """Exposes the last :class:`EngineStats` snapshot (refreshed by the /metrics handler)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None
        self.num_restarts = 0

    def collect(self):
        labels = ["model_name"]
        value = [self.model_name]
        restarts = CounterMetricFamily(
            "fw:engine_restarts", "Times the engine process was restarted after it died.", labels=labels
        )
        restarts.add_metric(value, self.num_restarts)
        yield restarts
        stats = self.stats
        if stats is None:
            return

        def gauge(name, doc, v):
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(value, v)
            return family

        def counter(name, doc, v):
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(value, v)
            return family

        yield gauge("fw:num_requests_running", "Requests being computed by the engine.", stats.num_running)
        yield gauge("fw:num_requests_waiting", "Requests queued in the engine.", stats.num_waiting)
        yield gauge("fw:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", stats.kv_cache_usage)
        yield gauge("fw:num_kv_blocks", "KV-cache blocks in total.", stats.num_blocks)
        yield gauge(
            "fw:num_kv_blocks_used", "KV-cache blocks referenced by requests.", stats.num_blocks - stats.num_free_blocks
        )
        yield counter(
            "fw:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries
        )
        yield counter("fw:prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits)
        yield counter("fw:num_preemptions", "Requests preempted (recomputed later).", stats.num_preemptions)
        yield counter("fw:prompt_tokens", "Prompt tokens computed.", stats.prompt_tokens)
        yield counter("fw:generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield counter(
            "fw:num_failed_steps",
            "Engine steps that raised (their requests failed, the engine went on).",
            stats.num_failed_steps,
        )


#: vLLM's older names of two metrics, exported too under ``vllm_names``.
VLLM_LEGACY_NAMES = {
    "fw:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "fw:inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
}


class _VLLMNames:
    """Every metric of ``source`` again, under its ``vllm:`` name (and its legacy name, if any)."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self):
        for family in self.source.collect():
            for name in (family.name.replace("fw:", "vllm:", 1), VLLM_LEGACY_NAMES.get(family.name)):
                if name is None or not name.startswith("vllm:"):
                    continue
                renamed = Metric(name, family.documentation, family.type, family.unit)
                renamed.samples = [
                    sample._replace(name=name + sample.name[len(family.name) :]) for sample in family.samples
                ]
                yield renamed


class ServerMetrics:
    """The app's registry plus the histograms handlers observe."""

    def __init__(self, model_name: str, vllm_names: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.vllm_registry: CollectorRegistry | None = None
        if vllm_names:
            self.vllm_registry = CollectorRegistry(auto_describe=False)
            self.vllm_registry.register(_VLLMNames(self.registry))
        self.engine = _EngineCollector(model_name)
        self.registry.register(self.engine)
        self.model_name = model_name
        kw = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram(
            "fw:time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS, **kw
        ).labels(model_name)
        self.itl = Histogram(
            "fw:inter_token_latency_seconds", "Time between two outputs of one sequence.", buckets=_ITL_BUCKETS, **kw
        ).labels(model_name)
        self.e2e = Histogram(
            "fw:e2e_request_latency_seconds", "Request latency, arrival to last token.", buckets=_E2E_BUCKETS, **kw
        ).labels(model_name)
        self._finished = Counter(
            "fw:request_success",
            "Finished requests by finish reason.",
            labelnames=["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.rejected = Counter("fw:request_rejected", "Requests refused by the queue cap (429).", **kw).labels(
            model_name
        )

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def render(self, stats: EngineStats | None, num_restarts: int = 0) -> bytes:
        self.engine.stats, self.engine.num_restarts = stats, num_restarts
        text = generate_latest(self.registry)
        return text + generate_latest(self.vllm_registry) if self.vllm_registry is not None else text


def stats_line(previous: EngineStats | None, current: EngineStats, interval_s: float) -> str:
    """The periodic log line: token throughput since ``previous`` (over ``interval_s``), the
    running and waiting requests, and the KV-cache and prefix-cache use."""
    prompt = current.prompt_tokens - (previous.prompt_tokens if previous else 0)
    generated = current.generation_tokens - (previous.generation_tokens if previous else 0)
    queries = current.prefix_cache_queries - (previous.prefix_cache_queries if previous else 0)
    hits = current.prefix_cache_hits - (previous.prefix_cache_hits if previous else 0)
    hit_rate = f"{100 * hits / queries:.1f}%" if queries else "-"
    return (
        f"fw: stats: prompt {prompt / interval_s:.1f} tok/s, generation {generated / interval_s:.1f} tok/s, "
        f"running {current.num_running}, waiting {current.num_waiting}, "
        f"KV cache {100 * current.kv_cache_usage:.1f}%, prefix cache hits {hit_rate}"
    )
