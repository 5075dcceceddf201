"""Prometheus metrics shaped like vLLM's, prefixed `oasiskv:`.

Request-level series (TTFT, ITL, TPOT, e2e latency, token and request counters) are updated by the
engine thread as it publishes outputs. Engine-level series (running/waiting, KV usage on GPU and host,
and every numeric counter of engine.stats_dict(): kv_hits, kv_bytes_gathered, prefetch bytes,
agreement, ...) come from a snapshot the engine thread takes when /metrics is scraped."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "oasiskv:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
ENGINE_COUNTERS = {"preemptions": "num_preemptions", "steps": "engine_steps", "prefill_tokens": "engine_prefill_tokens",
                   "decode_tokens": "engine_decode_tokens", "step_time_s": "engine_step_time_seconds"}
GAUGE_HINTS = ("rate", "agreement", "cap", "max_", "per_step", "_held")  # engine stats that are not running totals


class ServerMetrics:
    def __init__(self, model_name: str):
        disable_created_metrics()  # no `_created` series, as in vLLM's output
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.snapshot: dict = {}
        self.registry.register(EngineCollector(self))
        label = ["model_name"]

        def histogram(name, doc, buckets):
            return Histogram(P + name, doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(P + name, doc, label, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two outputs of a request", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "(e2e - ttft) / (output tokens - 1)",
                              ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish", E2E_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        self.success = Counter(P + "request_success", "Finished requests", ["model_name", "finished_reason"],
                               registry=self.registry)

    # -- called on the engine thread ---------------------------------------------------------------
    def on_tokens(self, t, n: int, now: float) -> None:
        if t.first_token is None:
            self.ttft.observe(now - t.arrival)
            self.prompt_tokens.inc(t.num_prompt_tokens)
        else:
            self.itl.observe(now - t.last_token)
        self.generation_tokens.inc(n)

    def on_finish(self, t, reason: str | None, now: float) -> None:
        self.success.labels(self.model_name, reason or "abort").inc()
        if reason == "abort":
            return
        self.e2e.observe(now - t.arrival)
        if t.first_token is not None and t.sent > 1:
            self.tpot.observe((now - t.first_token) / (t.sent - 1))

    # -- called by the /metrics route ----------------------------------------------------------------
    def render(self, snapshot: dict) -> bytes:
        self.snapshot = snapshot
        return generate_latest(self.registry)


class EngineCollector:
    """Series read from the latest engine snapshot at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        snap, name = self.metrics.snapshot, self.metrics.model_name
        if not snap:
            return
        gauges = {"num_requests_running": ("running", "Requests in the running batch"),
                  "num_requests_waiting": ("waiting", "Requests waiting to be scheduled"),
                  "kv_cache_usage_perc": ("gpu_kv_usage", "GPU KV cache usage, 0-1 (pool, or working-set rows)"),
                  "host_kv_cache_usage_perc": ("host_kv_usage", "Host KV store usage, 0-1"),
                  "host_kv_cache_used_bytes": ("host_kv_bytes_used", "Host KV store bytes held by requests"),
                  "kv_cache_used_blocks": ("kv_blocks_used", "KV blocks allocated to requests (pool or host store)")}
        for metric, (key, doc) in gauges.items():
            yield gauge(P + metric, doc, name, snap[key])
        stats = snap["stats"]
        yield info_gauge(name, stats)
        for key, value in stats.items():
            if isinstance(value, list) and all(is_number(v) or v is None for v in value):
                yield per_layer_gauge(key, value, name)
            elif is_number(value):
                yield engine_series(key, value, name)
        if "kv_hit_rate" not in stats and "kv_hits" in stats and "kv_misses" in stats:
            looked_up = stats["kv_hits"] + stats["kv_misses"]
            yield gauge(P + "kv_hit_rate", "Share of selected KV blocks already resident on the GPU", name,
                        stats["kv_hits"] / looked_up if looked_up else 0.0)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def series_name(key: str) -> str:
    name = P + ENGINE_COUNTERS.get(key, key if key.startswith("kv_") else f"engine_{key}")
    return name[:-2] + "_seconds" if key.endswith("_s") and key not in ENGINE_COUNTERS else name


def engine_series(key: str, value, model_name: str):
    """Engine counts are counters (`_total`); ratios, rates, caps and maxima are gauges."""
    name = series_name(key)
    if (isinstance(value, float) and not key.endswith("_s")) or any(h in key for h in GAUGE_HINTS):
        return gauge(name, f"engine.stats_dict()[{key!r}]", model_name, value)
    family = CounterMetricFamily(name, f"engine.stats_dict()[{key!r}]", labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def per_layer_gauge(key: str, values: list, model_name: str) -> GaugeMetricFamily:
    """A per-layer list (e.g. kv_agreement_per_layer) as one gauge with a `layer` label."""
    family = GaugeMetricFamily(series_name(key), f"engine.stats_dict()[{key!r}]", labels=["model_name", "layer"])
    for layer, value in enumerate(values):
        if value is not None:
            family.add_metric([model_name, str(layer)], float(value))
    return family


def gauge(name: str, doc: str, model_name: str, value) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model_name], float(value))
    return family


def info_gauge(model_name: str, stats: dict) -> GaugeMetricFamily:
    family = GaugeMetricFamily(P + "cache_config_info", "KV configuration (in labels)",
                               labels=["model_name", "kv_mode"])
    family.add_metric([model_name, str(stats.get("kv_mode", ""))], 1.0)
    return family
