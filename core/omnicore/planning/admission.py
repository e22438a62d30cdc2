"""Memory admission: refuse a request the engine's placement cannot hold, before it runs.

An engine with a memory limit (``Engine(device_memory=GiB)``, ``--device-memory``; on CUDA the device's total
memory by default) prices its own placement once, when it starts, with the planner (:func:`~.estimate.make_plan`
over the model plugin's meta-device ``plan_model``: the weight bytes each rank holds under its ``--parallel``,
``--offload`` and ``--quantization``, plus the fixed per-rank reserve). Each request is then sized by the model's
own ``plan_request`` (its rows, guidance branches, steps and caches such as a prompt K/V), and its activation peak
estimate (the planner's formula) is added to the resident bytes. A total over the limit is a
:class:`~omnicore.engine.limits.MemoryLimitExceeded` naming the estimate, the limit and the placement, raised in
``Engine.submit`` (so the server answers 400 and the CLI prints one line) instead of an out-of-memory error
mid-job. Nothing is built per request: ``plan_request`` reads the model's config file and does arithmetic.

On a CPU (or any non-CUDA) platform the check is **off** unless a limit is given: host memory is shared with
everything else on the machine and the tiny presets must never be refused by default. A model whose plugin does
not describe itself to the planner, or a request its ``plan_request`` cannot size (a conditioned mode the planner
does not model), is not checked; this is logged, never refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .estimate import GIB, CostModel, Placement, activation_bytes, make_plan, rank_rows, request_cache_bytes

logger = logging.getLogger("omnicore.planning")


@attrs.frozen
class MemoryEstimate:
    """One request's per-rank bytes on the engine's placement."""

    resident: int  # weights (+ the fixed reserve) already on each rank
    caches: int
    activations: int
    limit: int
    placement: str

    @property
    def total(self) -> int:
        return self.resident + self.caches + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.limit


@attrs.frozen
class MemoryGuard:
    """What the engine prices each request with (built once by :func:`build_guard`)."""

    profile: Any  # the plugin module holding plan_request
    root: Path
    limit: int  # bytes per rank
    limit_source: str  # e.g. "--device-memory 12 GiB", "cuda:0 total memory"
    row: Placement  # the engine's placement as the planner priced it
    shape: Mapping[str, Any]
    dtype_bytes: int
    caches: tuple[str, ...] = ()

    @property
    def resident(self) -> int:
        return sum(self.row.weights.values()) + self.row.reserve

    def estimate(self, request: Any) -> MemoryEstimate | None:
        """The per-rank estimate of ``request`` (a :class:`~omnicore.engine.request.GenerationRequest`), or None
        when its model cannot size it."""
        from ..errors import InvalidRequest

        try:
            sized = self.profile.plan_request(self.root, request_fields(request))
        except (InvalidRequest, ValueError, TypeError, KeyError) as exc:
            logger.info("memory check skipped: %s cannot size this request (%s)", self.row.name, exc)
            return None
        rows = rank_rows(int(sized["tokens"]), int(sized.get("cfg_branches", 1)), cfg=self.row.cfg,
                         ulysses=self.row.ulysses)
        act = activation_bytes(self.shape, rows, self.dtype_bytes, self.row.tp)
        caches = sum(request_cache_bytes(sized, self.shape, self.dtype_bytes, self.caches).values())
        return MemoryEstimate(resident=self.resident, caches=caches, activations=act, limit=self.limit,
                              placement=self.row.name)

    def check(self, request: Any) -> MemoryEstimate | None:
        """Raise :class:`~omnicore.engine.limits.MemoryLimitExceeded` when ``request`` does not fit."""
        from ..engine.limits import MemoryLimitExceeded

        est = self.estimate(request)
        if est is not None and not est.fits:
            raise MemoryLimitExceeded(
                "params", f"this request needs an estimated {size(est.total)} per rank on {est.placement} "
                          f"(weights and reserve {size(est.resident)} + activations {size(est.activations)}"
                          f" + caches {size(est.caches)}), more than the limit {size(est.limit)} "
                          f"({self.limit_source}); ask for a smaller size, fewer frames or outputs, or use more "
                          "devices / offload / quantization (omnicore plan shows which fit)",
                estimate_bytes=est.total, limit_bytes=est.limit, placement=est.placement)
        return est

    def check_resident(self) -> None:
        """Raise when the placement's weights alone exceed the limit (checked before the model loads)."""
        from ..engine.limits import MemoryLimitExceeded

        if self.resident > self.limit:
            raise MemoryLimitExceeded(
                "device_memory", f"{self.row.name} holds {size(self.resident)} per rank of weights and "
                                 f"reserve before any request, more than the limit {size(self.limit)} "
                                 f"({self.limit_source}); use more devices, offload or quantization "
                                 "(omnicore plan shows which fit)",
                estimate_bytes=self.resident, limit_bytes=self.limit, placement=self.row.name)
        if self.row.load_peak > self.limit:  # quantized / offloaded after the load: the whole weights come first
            raise MemoryLimitExceeded(
                "device_memory", f"{self.row.name} loads {size(self.row.load_peak)} per rank of unquantized weights "
                                 f"and reserve before quantizing or offloading them, more than the limit "
                                 f"{size(self.limit)} ({self.limit_source}); use more devices "
                                 "(omnicore plan shows which fit)",
                estimate_bytes=self.row.load_peak, limit_bytes=self.limit, placement=self.row.name)


def size(n: int) -> str:
    """Bytes as GiB (two decimals), or MiB below one GiB (tiny models)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2 ** 20:.1f} MiB"


def request_fields(request: Any) -> dict[str, Any]:
    """A :class:`GenerationRequest` as the JSON ``plan_request`` takes (sampling fields, ``extra``, prompt)."""
    p = request.params
    out: dict[str, Any] = {k: getattr(p, k) for k in ("height", "width", "num_frames", "fps", "duration",
                                                      "num_inference_steps", "guidance_scale")
                           if getattr(p, k, None) is not None}
    if int(getattr(p, "num_outputs", 1) or 1) > 1:
        out["num_outputs"] = int(p.num_outputs)
    extra = {k: v for k, v in dict(request.extra or {}).items() if not str(k).startswith("omnicore_")}
    if extra:
        out["extra"] = extra
    prompt = request.prompt
    if prompt:
        out["prompt"] = prompt if isinstance(prompt, str) else json.dumps(dict(prompt), sort_keys=True, default=str)
    if getattr(request, "modalities", None):
        out["modalities"] = list(request.modalities)
    return out


def device_limit(platform: Any, device_memory_gib: float | None) -> tuple[int, str] | None:
    """``(bytes, where it comes from)`` of the per-rank limit, or None (no check): an explicit ``device_memory``
    (GiB; 0 turns the check off), else a CUDA device's total memory, else none."""
    if device_memory_gib is not None:
        if device_memory_gib <= 0:
            return None
        return int(device_memory_gib * GIB), f"--device-memory {device_memory_gib:g} GiB"
    if getattr(platform, "name", None) == "cuda":  # pragma: no cover - no GPU here
        import torch

        device = platform.device()
        total = torch.cuda.get_device_properties(device).total_memory
        return int(total), f"{device} total memory"
    return None


def build_guard(spec: Any, root: str | Path, *, platform: Any, dtype: Any, device_memory_gib: float | None,
                parallel: Any = None, offload: str = "none", quantization: str | None = None,
                caches: tuple[str, ...] = (), model_options: Mapping[str, Any] | None = None) -> MemoryGuard | None:
    """The engine's guard, or None when there is no limit or the model does not describe itself to the planner.

    ``parallel`` is the engine's :class:`~omnicore.parallel.config.ParallelConfig`; the row priced is the one of
    the planner's candidates with the same degrees, offload and quantization; ``model_options`` are the
    engine's (``text_encoder_offload=cpu`` takes the text encoder off every accelerator rank's bytes)."""
    from ..errors import InvalidRequest
    from ..parallel.config import ParallelConfig
    from .estimate import host_components
    from .source import profile_module

    limit = device_limit(platform, device_memory_gib)
    if limit is None:
        return None
    profile = profile_module(spec)
    if profile is None:
        logger.info("memory check off: model %s does not describe itself to the planner", spec.name)
        return None
    import torch

    par = ParallelConfig.parse(parallel)
    root = Path(root)
    quant = quantization or "none"
    model = profile.plan_model(root, dtype)
    try:
        sized = profile.plan_request(root, {})
    except (InvalidRequest, ValueError, TypeError, KeyError) as exc:
        # the row's weights do not depend on the request (each request is sized on its own at submit); a model
        # whose defaults alone are not a request (MiniMax-H3's t2va needs an aspect ratio) still gets its row,
        # with both guidance branches so a cfg placement has one too
        logger.debug("pricing %s's placement without a default request (%s)", spec.name, exc)
        sized = {"tokens": 1, "cfg_branches": 2, "steps": 1}
    cost = CostModel.for_platform(getattr(platform, "name", None))  # the reserve --parallel auto planned with
    plan = make_plan(model=spec.name, spec=spec.name, source="engine", profile=model, request=sized, dtype=dtype,
                     devices=par.world_size, device_memory_bytes=limit[0], caches=caches, cost=cost,
                     parallel_dims=tuple(spec.capabilities.parallel), quantizations=(quant,),
                     quantized_dims=("cfg", "ulysses", "tp", "ep"),
                     host=host_components(model, model_options, getattr(platform, "name", None)))
    want = (par.cfg, par.ulysses, par.tp, par.ep, offload, quant)
    row = next((p for p in plan.placements
                if (p.cfg, p.ulysses, p.tp, p.ep, p.offload, p.quantization) == want), None)
    if row is None:
        logger.info("memory check off: the planner has no row for %s with offload %s (model %s)", par, offload,
                    spec.name)
        return None
    dtype_bytes = torch.empty((), dtype=dtype, device="meta").element_size()
    return MemoryGuard(profile=profile, root=root, limit=limit[0], limit_source=limit[1], row=row,
                       shape=dict(model["shape"]), dtype_bytes=dtype_bytes, caches=tuple(caches))


__all__ = ["MemoryEstimate", "MemoryGuard", "build_guard", "device_limit", "request_fields"]
