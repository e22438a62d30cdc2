"""Model-level side of the exact-schedule AdaLN cache: one cache slot, prepare / clear, step selection.

A model owns an :class:`AdaLNScheduleController` holding its projections (every block's, then the final
layer's) and its time embedder. Per request the denoise loop calls :meth:`prepare` once with the per-step
unique timesteps and the schedule key; every forward then calls :meth:`select` with ``adaln_step_index``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Final

import attrs
import torch

from .keys import ScheduleKey
from .projection import AdaLNProjection

logger = logging.getLogger("omnicore.cache.adaln_schedule")

_GIB = float(1 << 30)


class _Absent:
    def __repr__(self) -> str:
        return "ABSENT"


ABSENT: Final = _Absent()
"""Marks an ``adaln_step_index`` keyword that was not passed at all (distinct from an explicit ``None``)."""


@attrs.frozen(eq=False)
class AdaLNScheduleCache:
    """What one prepared schedule holds (identity matters: the same key returns the same object)."""

    key: ScheduleKey
    t_embs: tuple[torch.Tensor, ...]
    cursor: torch.Tensor
    steps: int
    max_unique_timesteps: int
    table_bytes: int
    projection_bytes: int
    offloaded_projection_bytes: int

    @property
    def net_memory_saved_bytes(self) -> int:
        return self.offloaded_projection_bytes - self.table_bytes


class AdaLNScheduleController:
    """``projections()`` returns the projections in model order; ``time_embedder(unique_timesteps)`` maps a
    step's unique timesteps to ``t_emb``; ``empty_cache`` releases the platform allocator cache after an
    offload (e.g. ``platform.empty_cache``).

    ``release_cached_memory(device)``, when set, is called too after an offload moved bytes off ``device``: the
    ``adaln_schedule`` cache method sets it to the release of the platform serving that device, so the freed
    weight storage goes back to the device instead of staying reserved by its caching allocator (CUDA, NPU)."""

    def __init__(self, projections: Callable[[], Sequence[AdaLNProjection]],
                 time_embedder: Callable[[torch.Tensor], torch.Tensor],
                 empty_cache: Callable[[], None] | None = None) -> None:
        self._projections = projections
        self._time_embedder = time_embedder
        self._empty_cache = empty_cache
        self.release_cached_memory: Callable[[torch.device], None] | None = None
        self.cache: AdaLNScheduleCache | None = None

    @property
    def projections(self) -> tuple[AdaLNProjection, ...]:
        return tuple(self._projections())

    # ------------------------------------------------------------------ prepare / clear
    def prepare(self, plan: Sequence[torch.Tensor], key: Sequence[Sequence[int]],
                offload_weights: bool = False) -> AdaLNScheduleCache | None:
        """Build (or reuse) the tables for ``plan`` (per step: its unique timesteps on the model device).

        Returns the held cache (same object for an equal key), a new one, or ``None`` when weight offload was
        requested but the tables would not be smaller than the weights (the request then runs the direct
        projection and no table is kept).
        """
        if len(plan) == 0:
            raise ValueError("AdaLN schedule plan must contain at least one denoise step")
        if len(key) != len(plan):
            raise ValueError("AdaLN schedule key/plan length mismatch")
        norm_key: ScheduleKey = tuple(tuple(int(b) for b in step) for step in key)
        held = self.cache
        if held is not None and held.key == norm_key:
            return held
        with torch.no_grad():
            return self._build(plan, norm_key, offload_weights)

    def _build(self, plan: Sequence[torch.Tensor], key: ScheduleKey, offload_weights: bool
               ) -> AdaLNScheduleCache | None:
        projections = self.projections
        for proj in projections:
            proj.restore()
        t_embs = tuple(self._time_embedder(ts) for ts in plan)
        devices = {t.device for t in t_embs} | {ts.device for ts in plan}
        if len(devices) != 1:
            raise ValueError(f"AdaLN schedule tensors must be on one device, got {sorted(map(str, devices))}")
        device = devices.pop()
        cursor = torch.zeros((), dtype=torch.int64, device=device)
        tables = [proj.build_table(t_embs) for proj in projections]  # live projections untouched so far
        table_bytes = sum(t.numel() * t.element_size() for t in tables)
        projection_bytes = sum(p.projection_bytes() for p in projections)
        offload_supported = offload_weights and all(p.offload_eligible() for p in projections)
        if offload_supported and table_bytes >= projection_bytes:
            self.clear()
            logger.warning("AdaLN schedule tables (%.3f GiB) are not smaller than the projection weights "
                           "(%.3f GiB); running the direct projection without tables",
                           table_bytes / _GIB, projection_bytes / _GIB)
            return None
        for proj, table in zip(projections, tables):
            proj.install(table, cursor)
        offloaded = 0
        if offload_supported:
            try:
                for proj in projections:
                    offloaded += proj.offload()
            except Exception:
                logger.exception("AdaLN projection offload failed; keeping tables and weights resident")
                for proj in projections:
                    proj.restore()
                offloaded = 0
        elif offload_weights:
            logger.warning("AdaLN projection weight offload requested but unsupported (DTensor, meta or empty "
                           "parameters); keeping tables, offloading nothing")
        if offloaded and self._empty_cache is not None:
            self._empty_cache()
        if offloaded and self.release_cached_memory is not None:
            self.release_cached_memory(device)
        cache = AdaLNScheduleCache(
            key=key, t_embs=t_embs, cursor=cursor, steps=len(plan),
            max_unique_timesteps=max(int(ts.shape[0]) for ts in plan), table_bytes=table_bytes,
            projection_bytes=projection_bytes, offloaded_projection_bytes=offloaded,
        )
        self.cache = cache
        logger.info("AdaLN schedule cache: %d steps, tables %.3f GiB, offloaded %.3f GiB, net saved %.3f GiB",
                    cache.steps, table_bytes / _GIB, offloaded / _GIB, cache.net_memory_saved_bytes / _GIB)
        return cache

    def clear(self) -> None:
        """Restore every projection's weights and drop the tables (no-op without a cache)."""
        if self.cache is None and not any(p.table is not None or p.offloaded for p in self.projections):
            return
        for proj in self.projections:
            proj.clear()
        self.cache = None

    # ------------------------------------------------------------------ per-forward step selection
    def select(self, adaln_step_index: object = ABSENT) -> torch.Tensor | None:
        """The cached ``t_emb`` of the step (cursor moved there), or ``None`` for the normal path."""
        cache = self.cache
        if cache is None:
            if adaln_step_index is ABSENT:
                return None
            raise ValueError("adaln_step_index was supplied without a prepared AdaLN schedule")
        if adaln_step_index is ABSENT or isinstance(adaln_step_index, bool) or not isinstance(adaln_step_index, int):
            raise ValueError(f"adaln_step_index must be an int while the AdaLN schedule cache is active, "
                             f"got {adaln_step_index!r}")
        if not 0 <= adaln_step_index < cache.steps:
            raise ValueError(f"adaln_step_index {adaln_step_index} is outside [0, {cache.steps})")
        cache.cursor.fill_(adaln_step_index)
        return cache.t_embs[adaln_step_index]
