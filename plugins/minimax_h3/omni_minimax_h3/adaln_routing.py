"""The exact-schedule AdaLN cache on a combined (FL2VA + Ref2VA) deployment: one table set per DiT.

The core's ``adaln_schedule`` method holds one controller per pipeline and prepares it with each batch's schedule.
Handing it the FL2VA DiT's controller made every Ref2VA batch rebuild (and evict) the FL2VA tables — for
projections that batch never runs — and the next FL2VA batch rebuild them again. :class:`PartitionAdaLN` is that
one controller for the whole deployment: each batch's plan says which partition it is for
(:class:`PartitionPlan`), and the prepare goes to that DiT's own controller, whose single slot then keeps its own
latest schedule. Alternating t2va and ref2va batches each reuse their DiT's tables; Ref2VA batches get tables too
(they ran the direct projections before).

Known cost with ``--offload model``: the core method loads every offloaded module holding one of the controller's
projections before a new batch's first step, so the idle DiT's weights are loaded too and stay until its next
forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from omnicore.plugin import ABSENT, AdaLNScheduleController


class PartitionPlan(list):
    """A batch's per-step unique timesteps (the ``adaln_schedule_plan``) and the partition whose DiT runs it."""

    def __init__(self, steps: Sequence[torch.Tensor], partition: str) -> None:
        super().__init__(steps)
        self.partition = partition


class PartitionAdaLN(AdaLNScheduleController):
    """Routes ``prepare`` to the controller of the DiT serving the plan's partition (see the module docstring).

    ``projections`` are every DiT's (offload keeps them all resident for the cache); ``clear`` clears each DiT;
    ``cache`` is the most recently prepared schedule's (for inspection). Forwards select their step on their own
    DiT's controller, never here."""

    def __init__(self, dits: Mapping[str, Any]) -> None:
        self.dits = dict(dits)
        self._last: str | None = None
        super().__init__(self._all_projections, self._no_time_embedder)

    def _all_projections(self) -> list[Any]:
        return [p for dit in self.dits.values() for p in dit.adaln.projections]

    @staticmethod
    def _no_time_embedder(unique_timesteps: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("PartitionAdaLN builds no tables itself: each DiT's controller does")

    def controller(self, partition: str) -> AdaLNScheduleController:
        """The AdaLN controller of the DiT serving ``partition``."""
        return self.dits[partition].adaln

    @property
    def cache(self) -> Any:
        return None if self._last is None else self.controller(self._last).cache

    @cache.setter
    def cache(self, value: Any) -> None:  # the base initialiser sets it; the DiTs' controllers own the slots
        if value is not None:
            raise AttributeError("PartitionAdaLN holds no cache of its own")

    def prepare(self, plan: Sequence[torch.Tensor], key: Sequence[Sequence[int]],
                offload_weights: bool = False) -> Any:
        partition = getattr(plan, "partition", None)
        if partition not in self.dits:
            raise ValueError(f"a combined deployment's AdaLN plan must name its partition (one of "
                             f"{', '.join(self.dits)}), got {partition!r}")
        self._last = partition
        return self.controller(partition).prepare(list(plan), key, offload_weights=offload_weights)

    def clear(self) -> None:
        for dit in self.dits.values():
            dit.adaln.clear()
        self._last = None

    def select(self, adaln_step_index: Any = ABSENT) -> torch.Tensor | None:
        raise RuntimeError("a combined deployment's DiTs select their step on their own AdaLN controller")
