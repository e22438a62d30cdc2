"""LoRA over HTTP: the ``lora`` request field, the adapters ``/v1/models`` lists, and the registry's ``/metrics``.

``lora: [{"name": ..., "scale": ...}, {"path": ..., "scale": ...}]`` on images (generations, edits) and videos
becomes ``GenerationRequest.loras``. The schema (``schemas.LoraRef``) checks shapes and ranges; the engine reads and
checks each adapter against the model when the request is submitted, so a bad adapter is a 400 naming it (and the
key) before anything is queued. A ``name`` is an adapter the server preloaded (``--lora-modules``); a ``path`` lies
under one of the server's ``--lora-dir`` directories — the registry never opens anything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .errors import ApiError

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from ..lora.records import LoRA
    from ..lora.registry import AdapterRegistry
    from .app import ServerContext


def request_loras(refs: Sequence[Any] | None) -> tuple[LoRA, ...]:  # LoraRef items (name or path)
    """The ``lora`` DTO items as :class:`~omnicore.lora.LoRA` records (in order: adapters compose)."""
    from ..errors import InvalidRequest
    from ..lora.records import LoRA

    out = []
    for i, ref in enumerate(refs or ()):
        field = "name" if ref.name is not None else "path"
        try:
            out.append(LoRA(ref.name if ref.name is not None else ref.path, ref.scale))
        except InvalidRequest as exc:  # (the schema's bounds are the record's, so this is a NUL in a name)
            raise ApiError(400, "invalid_value", f"lora[{i}].{field}: {exc.rule}", param=f"lora[{i}].{field}") \
                from None
    return tuple(out)


def registry_of(engine: object) -> AdapterRegistry | None:
    """The adapter registry of a loaded engine (``None`` for engines without one, e.g. test doubles)."""
    return getattr(engine, "lora_registry", None)


def adapter_cards(registry: AdapterRegistry | None) -> list[dict[str, object]]:
    """The ``/v1/models`` entries of a registry's preloaded adapters: name, layout, rank, adapted modules and the
    base model an adapter config names (read from file headers; server paths are not shown)."""
    if registry is None:
        return []
    from ..cli.lora_args import describe_adapter

    cards = []
    for name in registry.list_modules():
        info = describe_adapter(name, str(registry.modules[name]))
        info.pop("path", None)
        cards.append({"object": "lora", **info})
    return cards


def engines(ctx: ServerContext) -> Iterator[tuple[str, object]]:
    """``(model id, engine)`` for every loaded engine of the server (one, or each loaded model of a pool)."""
    pool = getattr(ctx, "pool", None)
    if pool is not None:
        for model in pool.models:
            engine = pool.engine_of(model)
            if engine is not None:
                yield model, engine
    elif ctx.engine is not None and ctx.served is not None:
        yield ctx.served.id, ctx.engine


_COUNTERS = {"loads": "adapter files read and converted for a model",
             "hits": "adapter lookups served from host memory (no file read)",
             "uploads": "host-to-device copies of adapters",
             "evictions": "device copies dropped by the LRU budget (the host copy stays)",
             "host_evictions": "host copies dropped by the host budget (read from the file again when asked for)"}
_GAUGES = {"device_bytes": "bytes of adapters on the device",
           "batch_bytes": "bytes of the running batch's stacked adapter slots on the device (in the device budget)",
           "host_bytes": "bytes of converted adapters in host memory", "device_adapters": "adapters with a device copy",
           "host_adapters": "converted adapters in host memory"}


class LoraCollector:
    """Prometheus collector of every served model's adapter registry stats, read at scrape time:
    ``omnicore_lora_<counter>_total`` and ``omnicore_lora_<gauge>``, labelled by model."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def describe(self) -> Iterable[Metric]:
        return self._families({})

    def collect(self) -> Iterable[Metric]:
        stats = {}
        for model, engine in engines(self.ctx):
            registry = registry_of(engine)
            if registry is not None:
                stats[model] = registry.stats()
        return self._families(stats)

    @staticmethod
    def _families(stats: dict[str, dict[str, int]]) -> list[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families: list[Metric] = []
        for key, text in _COUNTERS.items():
            fam = CounterMetricFamily(f"omnicore_lora_{key}", f"LoRA: {text}", labels=("model",))
            for model, values in stats.items():
                fam.add_metric((model,), float(values.get(key, 0)))
            families.append(fam)
        for key, text in _GAUGES.items():
            gauge = GaugeMetricFamily(f"omnicore_lora_{key}", f"LoRA: {text}", labels=("model",))
            for model, values in stats.items():
                gauge.add_metric((model,), float(values.get(key, 0)))
            families.append(gauge)
        return families


def list_adapters(ctx: ServerContext) -> None:
    """Put each loaded engine's preloaded adapters on its served model (``/v1/models`` lists them)."""
    import attrs

    for model, engine in engines(ctx):
        cards = tuple(adapter_cards(registry_of(engine)))
        if getattr(ctx, "pool", None) is not None and model in ctx.models:
            ctx.models[model] = attrs.evolve(ctx.models[model], loras=cards)
        elif ctx.served is not None and ctx.served.id == model:
            ctx.served = attrs.evolve(ctx.served, loras=cards)


def install(ctx: ServerContext) -> None:
    """Register the LoRA collector on the app's metrics registry, and list the adapters once a model is ready."""
    ctx.metrics.registry.register(LoraCollector(ctx))
    ctx.readiness.on_change(lambda state: list_adapters(ctx) if state == "ok" else None)


__all__ = ["LoraCollector", "adapter_cards", "engines", "install", "list_adapters", "registry_of", "request_loras"]
