"""The per-rank view of a worker group: this rank's coordinates, its process groups, and a traffic counter.

A :class:`ParallelContext` reaches a pipeline as ``LoadOptions.parallel`` (``None`` in a single-process engine).
Models ask it for their share of the work (``cfg_rank``, ``sp_rank``, ``tp_rank``, ``ep_rank``) and use the
collectives in :mod:`omnicore.parallel.collectives` on its groups. Every collective records the bytes this rank
sends, so a benchmark can compare the measured volume with the analytic one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import attrs

from .config import ParallelConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh


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
    """This rank in a ``cfg x ulysses x ep x tp`` grid (see :class:`~omnicore.parallel.config.ParallelConfig`).

    ``cfg_group`` joins the ranks holding the other guidance branch at the same sequence and TP position;
    ``sp_group`` the ranks of this rank's Ulysses group; ``tp_group`` those of its TP group, and ``tp_mesh`` the
    1-D ``DeviceMesh`` over it that DTensor's tensor parallelism runs on; ``ep_group`` the ranks sharing out the MoE
    experts. Each is ``None`` when its degree is 1.
    """

    config: ParallelConfig
    rank: int
    cfg_group: ProcessGroup | None = None
    sp_group: ProcessGroup | None = None
    stats: CommStats = attrs.Factory(CommStats)
    tp_group: ProcessGroup | None = None
    tp_mesh: DeviceMesh | None = None
    ep_group: ProcessGroup | None = None

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
    def tp(self) -> int:
        return self.config.tp

    @property
    def tp_rank(self) -> int:
        return self.config.grid(self.rank)[2]

    @property
    def ep(self) -> int:
        return self.config.ep

    @property
    def ep_rank(self) -> int:
        return self.config.grid4(self.rank)[2]

    @property
    def is_driver(self) -> bool:
        """Rank 0 owns the scheduler, the API and the outputs."""
        return self.rank == 0


def _peer_groups(config: ParallelConfig, rank: int,
                 peers: Callable[[int], Iterable[int]]) -> ProcessGroup:
    """Create every group of one dimension (each rank takes part in creating all of them, in the same order)
    and return ``rank``'s."""
    import torch.distributed as dist

    mine: ProcessGroup | None = None
    seen: set[tuple[int, ...]] = set()
    for r in range(config.world_size):
        ranks = tuple(peers(r))
        if ranks in seen:
            continue
        seen.add(ranks)
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    assert mine is not None, f"rank {rank} is in no group of {peers}"  # (the peers of a dimension cover every rank)
    return mine


def build_groups(config: ParallelConfig, rank: int) -> ParallelContext:
    """Create the CFG, Ulysses, TP and EP sub-groups (every rank must call this, in the same order) for
    ``rank``."""
    cfg_group = _peer_groups(config, rank, config.cfg_peers) if config.cfg > 1 else None
    sp_group = _peer_groups(config, rank, config.ulysses_peers) if config.ulysses > 1 else None
    tp_group = tp_mesh = None
    if config.tp > 1:
        from torch.distributed.device_mesh import DeviceMesh

        from .collectives import group_device_type

        tp_group = _peer_groups(config, rank, config.tp_peers)
        tp_mesh = DeviceMesh.from_group(tp_group, group_device_type())
    ep_group = _peer_groups(config, rank, config.ep_peers) if config.ep > 1 else None
    return ParallelContext(config=config, rank=rank, cfg_group=cfg_group, sp_group=sp_group, tp_group=tp_group,
                           tp_mesh=tp_mesh, ep_group=ep_group)


__all__ = ["CommStats", "ParallelContext", "build_groups"]
