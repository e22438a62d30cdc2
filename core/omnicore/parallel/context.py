"""The per-rank view of a worker group: this rank's coordinates, its process groups, and a traffic counter.

A :class:`ParallelContext` reaches a pipeline as ``LoadOptions.parallel`` (``None`` in a single-process engine).
Models ask it for their share of the work (``cfg_rank``, ``sp_rank``) and use the collectives in
:mod:`omnicore.parallel.collectives` on its groups. Every collective records the bytes this rank sends, so a
benchmark can compare the measured volume with the analytic one.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs

from .config import ParallelConfig


class CommStats:
    """Bytes this rank sent per collective kind (thread-safe; reset by whoever measures)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent_bytes: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def record(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.sent_bytes[kind] = self.sent_bytes.get(kind, 0) + int(nbytes)
            self.calls[kind] = self.calls.get(kind, 0) + 1

    def reset(self) -> None:
        with self._lock:
            self.sent_bytes.clear()
            self.calls.clear()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"sent_bytes": dict(self.sent_bytes), "calls": dict(self.calls),
                    "total_sent_bytes": sum(self.sent_bytes.values())}


@attrs.define(eq=False)
class ParallelContext:
    """This rank in a ``cfg x ulysses`` grid (see :class:`~omnicore.parallel.config.ParallelConfig`).

    ``cfg_group`` joins the ranks holding the other guidance branch at the same sequence position;
    ``sp_group`` the ranks of this rank's Ulysses group. Either is ``None`` when its degree is 1.
    """

    config: ParallelConfig
    rank: int
    cfg_group: Any = None
    sp_group: Any = None
    stats: CommStats = attrs.Factory(CommStats)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def cfg(self) -> int:
        return self.config.cfg

    @property
    def ulysses(self) -> int:
        return self.config.ulysses

    @property
    def cfg_rank(self) -> int:
        return self.config.coords(self.rank)[0]

    @property
    def sp_rank(self) -> int:
        return self.config.coords(self.rank)[1]

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler, the API and the outputs."""
        return self.rank == 0


def build_groups(config: ParallelConfig, rank: int) -> ParallelContext:
    """Create the CFG and Ulysses sub-groups (every rank must call this, in the same order) for ``rank``."""
    import torch.distributed as dist

    cfg_group = sp_group = None
    if config.cfg > 1:  # one group per Ulysses position; every rank takes part in creating all of them
        for sp in range(config.ulysses):
            ranks = [c * config.ulysses + sp for c in range(config.cfg)]
            group = dist.new_group(ranks)
            if rank in ranks:
                cfg_group = group
    if config.ulysses > 1:
        for c in range(config.cfg):
            ranks = list(range(c * config.ulysses, (c + 1) * config.ulysses))
            group = dist.new_group(ranks)
            if rank in ranks:
                sp_group = group
    return ParallelContext(config=config, rank=rank, cfg_group=cfg_group, sp_group=sp_group)


__all__ = ["CommStats", "ParallelContext", "build_groups"]
