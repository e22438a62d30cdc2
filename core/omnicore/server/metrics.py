"""Prometheus metrics for one app, on a private ``CollectorRegistry``.

A per-app registry (not the process-global one) lets several apps live in one process: tests build many.
Gauges that mirror engine state (queue depth, running) are refreshed at scrape time. Stage timers use the
stage names of the job ``timings`` object, plus ``unaccounted`` for wall time outside the timed stages.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800)


class Metrics:
    """All ``omnicore_*`` series. ``refresh`` is called before each scrape to update the gauges."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter("omnicore_http_requests", "HTTP requests served", ("route", "status"),
                                     registry=r)
        self.http_duration = Histogram("omnicore_http_request_duration_seconds", "HTTP request latency",
                                       ("route",), buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("omnicore_queue_depth", "Jobs waiting in the engine queue", registry=r)
        self.running = Gauge("omnicore_jobs_running", "Jobs the engine is running", registry=r)
        self.jobs = Counter("omnicore_jobs", "Jobs that reached a terminal status", ("task", "status"), registry=r)
        self.stage = Histogram("omnicore_job_stage_seconds", "Time per job stage", ("stage",),
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.step = Histogram("omnicore_denoise_step_seconds", "Denoise step latency", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.steps = Counter("omnicore_denoise_steps", "Denoise steps executed", ("result",), registry=r)
        self.cancel_latency = Histogram("omnicore_cancel_latency_seconds",
                                        "Time from a cancel request to the worker's acknowledgement",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.ready = Gauge("omnicore_ready", "1 when the server admits work", registry=r)
        self.device_peak = Gauge("omnicore_device_memory_peak_bytes", "Peak device memory of the last job",
                                 ("device",), registry=r)
        self.load_peak_rss = Gauge("omnicore_load_peak_rss_bytes", "Peak host RSS of each rank of the engine when "
                                   "its model load ended (rank 0: during the load; a worker: since it was spawned)",
                                   ("rank",), registry=r)
        self.plugins = Gauge("omnicore_plugins", "Discovered plugins by load status", ("plugin", "status"),
                             registry=r)
        # usage per API key, labelled by key id (auth.key_id, never the key; "none" while auth is off)
        self.key_jobs = Counter("omnicore_key_jobs", "Jobs that reached a terminal status, per API key id",
                                ("key_id", "status"), registry=r)
        self.key_steps = Counter("omnicore_key_denoise_steps", "Denoise steps computed for each API key id",
                                 ("key_id",), registry=r)
        self.key_compute = Counter("omnicore_key_compute_seconds",
                                   "Seconds jobs of each API key id ran on the worker (device time; batched jobs "
                                   "each count the batch's time)", ("key_id",), registry=r)
        self._refreshers: list[Callable[[], None]] = []

    def on_scrape(self, fn: Callable[[], None]) -> None:
        self._refreshers.append(fn)

    def render(self) -> bytes:
        for fn in self._refreshers:
            fn()
        return generate_latest(self.registry)


# Engine/server timing keys -> ``omnicore_job_stage_seconds`` stages.
STAGE_KEYS = {"preprocess_s": "preprocess", "encode_s": "encode", "denoise_s": "denoise", "decode_s": "decode",
              "postprocess_s": "encode_output"}


def observe_stages(metrics: Metrics, timings: dict[str, float], wall_s: float) -> None:
    """Record each timed stage of one finished job, and the rest of its wall time as ``unaccounted``."""
    timed = 0.0
    for key, stage in STAGE_KEYS.items():
        value = timings.get(key)
        if isinstance(value, (int, float)):
            metrics.stage.labels(stage=stage).observe(float(value))
            timed += float(value)
    metrics.stage.labels(stage="unaccounted").observe(max(0.0, wall_s - timed))
