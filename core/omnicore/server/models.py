"""The models a server serves when it runs a :class:`~omnicore.pool.ModelPool`: routing by the request's
``model``, the ``/v1/models`` cards with each model's state, and the per-model ``/metrics`` series.

A one-model server never reaches this module (its single :class:`~.translate.ServedModel` answers every request,
as before). With a pool, a request without ``model`` goes to the first model configured.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import attrs

from .errors import ApiError
from .translate import ServedModel

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from ..pool.pool import ModelPool
    from .app import ServerContext
    from .metrics import Metrics


def served_models(pool: ModelPool, created: int) -> dict[str, ServedModel]:
    """``{name: ServedModel}`` for every model of ``pool``, each answering to the names the pool gives it."""
    out: dict[str, ServedModel] = {}
    for name in pool.models:
        entry = pool.entry_of(name)
        served = ServedModel.from_spec(pool.spec_of(name), None, created=created, model_options=dict(entry.options))
        out[name] = attrs.evolve(served, id=name, names=pool.names_of(name))
    return out


def route(models: dict[str, ServedModel], model: str | None) -> ServedModel:
    """The served model a request's ``model`` names (``None``: the first one); 404 naming the served models."""
    if model is None:
        return next(iter(models.values()))
    for served in models.values():
        if model in served.names:
            return served
    listing = ", ".join(f"{m.id!r}" for m in models.values())
    raise ApiError(404, "model_not_found", f"model {model!r} is not served here; this server serves {listing} "
                                           "(GET /v1/models lists them with their aliases)", param="model")


def model_card(ctx: ServerContext, served: ServedModel) -> dict[str, Any]:
    """``served.card()`` plus the pool's view of the model: ``state``, resident bytes, queue, counters."""
    pool = ctx.pool
    assert pool is not None  # (a pool server: ServerContext.served_for routed the request here)
    card = served.card(getattr(pool.platform, "name", None))
    status = pool.status()[served.id]
    c = status.counters
    card["omnicore"].update({
        "state": status.state, "pinned": status.pinned, "priority": status.priority,
        "resident_bytes": status.resident_bytes, "size_bytes": status.size_bytes,
        "size_measured": status.size_measured, "queued": status.queued, "running": status.running,
        "error": status.error,
        "swaps": {"loads": c.loads, "restores": c.restores, "offloads": c.offloads, "unloads": c.unloads,
                  "load_failures": c.load_failures},
    })
    return card


def install_metrics(metrics: Metrics, pool: ModelPool) -> None:
    """Register the per-model series on the app's registry (read from the pool at each scrape)."""
    metrics.registry.register(_PoolCollector(pool))


class _PoolCollector:
    """``omnicore_model_*``: queue length, running jobs, resident bytes, state, swap counts and seconds."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def describe(self) -> list[Metric]:
        return []  # (the series depend on the pool's models; nothing to check at registration)

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from ..pool.pool import STATES

        status = self.pool.status()
        queue = GaugeMetricFamily("omnicore_model_queue_length", "Requests waiting for a model: in the pool while "
                                  "it is not loaded, plus its engine's queue", labels=["model"])
        running = GaugeMetricFamily("omnicore_model_jobs_running", "Jobs a model's engine is running",
                                    labels=["model"])
        resident = GaugeMetricFamily("omnicore_model_resident_bytes", "Bytes of a model's parameters and buffers "
                                     "on the device (0 when offloaded or unloaded)", labels=["model"])
        state = GaugeMetricFamily("omnicore_model_state", "1 for the state each model is in", labels=["model",
                                                                                                         "state"])
        swaps = CounterMetricFamily("omnicore_model_swaps", "Loads (an engine built), restores (offloaded -> "
                                    "loaded), offloads, unloads and failed loads per model", labels=["model",
                                                                                                     "action"])
        seconds = CounterMetricFamily("omnicore_model_swap_seconds", "Seconds spent per model and swap action",
                                      labels=["model", "action"])
        for name, s in status.items():
            queue.add_metric([name], s.queued)
            running.add_metric([name], s.running)
            resident.add_metric([name], s.resident_bytes)
            for st in STATES:
                state.add_metric([name, st], 1.0 if s.state == st else 0.0)
            c = s.counters
            for action, count, secs in (("load", c.loads, c.load_seconds), ("restore", c.restores, c.restore_seconds),
                                        ("offload", c.offloads, c.offload_seconds),
                                        ("unload", c.unloads, c.unload_seconds), ("load_failure", c.load_failures,
                                                                                  0.0)):
                swaps.add_metric([name, action], count)
                seconds.add_metric([name, action], secs)
        budget = GaugeMetricFamily("omnicore_memory_budget_bytes", "The model pool's device memory budget")
        budget.add_metric([], self.pool.memory_budget)
        yield from (queue, running, resident, state, swaps, seconds, budget)
