"""What ``Engine(..., parallel=...)`` calls: check that the model can run this way, then start the worker group.

Checks made before any process starts (each names the ``parallel`` setting): the model's spec declares every
dimension asked for (``ModelCapabilities.parallel``). Cache methods run on every rank, enabled with rank 0's
configs after each rank's load; they take their decisions alike on every rank (:mod:`omnicore.parallel.consensus`).
Head counts are the model's to check at load (:func:`omnicore.parallel.ulysses.check_heads`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedFeature
from .config import ParallelConfig
from .worker import RankSpec

if TYPE_CHECKING:
    from ..config import Settings
    from ..platforms.base import Platform
    from ..specs import ModelSpec
    from .group import WorkerGroup


def check_parallel(config: ParallelConfig, spec: ModelSpec, cache_methods: Sequence[Any] = ()) -> None:
    """Refuse a parallel layout the model does not declare (cache methods are allowed: every rank runs them)."""
    missing = [d for d in config.dims() if d not in spec.capabilities.parallel]
    if missing:
        declared = ", ".join(spec.capabilities.parallel) or "none"
        why = ""
        if "cfg" in missing and spec.defaults.guidance_scale <= 1.0:
            why = ("; it runs without classifier-free guidance (guidance-distilled: one forward per step), so "
                   "there is no second branch for a cfg rank")
        raise UnsupportedFeature("parallel", f"model {spec.name!r} does not implement {', '.join(missing)} "
                                             f"parallelism (it declares: {declared}){why}")


def start_group(config: ParallelConfig, spec: ModelSpec, model: str, platform: Platform, settings: Settings, *,
                offload: str = "none", model_options: Mapping[str, Any] | None = None,
                vae_decode_precision: str | None = None, cache_methods: Sequence[Any] = (),
                timeout_s: float = 600.0, quantization: str | None = None,
                lora_budgets: tuple[int | None, int | None] = (None, None)) -> WorkerGroup | None:
    """Rank 0's :class:`~.group.WorkerGroup` for ``config`` (``None`` without parallelism); ``lora_budgets`` are
    rank 0's LoRA cache budgets ``(device, host)``, which every rank keeps too."""
    if not config.enabled:
        return None
    check_parallel(config, spec, cache_methods)
    from .group import WorkerGroup

    rank_spec = RankSpec(model=model, config=config, backend=platform.dist_backend(), platform=platform.name,
                         offload=offload, model_options=dict(model_options or {}),
                         vae_decode_precision=vae_decode_precision, settings=settings.as_dict(), timeout_s=timeout_s,
                         quantization=quantization, cache_methods=_cache_pairs(cache_methods),
                         lora_budgets=lora_budgets)
    return WorkerGroup.start(rank_spec, platform.device_type)


def _cache_pairs(methods: Sequence[Any]) -> tuple[tuple[str, Any], ...]:
    """``(name, config)`` of each cache method (a bare name: its default config), to enable on every rank."""
    return tuple((m, None) if isinstance(m, str) else (str(m[0]), m[1]) for m in methods)


__all__ = ["check_parallel", "start_group"]
