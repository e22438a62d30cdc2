"""``--parallel cfg=2,ulysses=2,tp=2,ep=2``: the parallel degrees of one engine and the rank layout they imply.

Ranks form a ``cfg x ulysses x ep x tp`` grid, tp fastest, then ep, ulysses, cfg slowest: rank
``r = ((cfg_rank * ulysses + sp_rank) * ep + ep_rank) * tp + tp_rank``. The dimension that talks most sits
innermost: tensor parallelism all-reduces twice per block, so a TP group is consecutive ranks (one node, the
fastest links); an expert-parallel group (per MoE layer: two all-to-alls dispatching token copies to their experts'
ranks and back plus a gather of the token slices by default, or one all-reduce with ``ep_dispatch=all_reduce``)
comes next, its members ``tp`` ranks apart; then a Ulysses group (four all-to-alls per attention); the CFG exchange
(once per step) crosses the slowest links. With ``tp=ep=1`` this is the former ``cfg x ulysses`` layout. A rank's
Ulysses shard holds the heads of its TP shard, so attention heads must divide by ``tp * ulysses``.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from ..errors import ConfigError

DIMENSIONS = ("cfg", "ulysses", "tp", "ep")


@attrs.frozen
class ParallelConfig:
    """Degrees per dimension; ``cfg`` is 1 or 2 (the two guidance branches), ``ulysses``, ``tp`` and ``ep`` any
    positive int (the model refuses, at load, a degree its heads or experts do not divide)."""

    cfg: int = 1
    ulysses: int = 1
    tp: int = 1
    ep: int = 1  # MoE experts partitioned over the ranks (their tokens are replicated there)

    def __attrs_post_init__(self) -> None:
        for name in DIMENSIONS:
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError("parallel", f"{name} must be a positive integer, got {value!r}")
        if self.cfg > 2:
            raise ConfigError("parallel", f"cfg must be 1 or 2 (a conditional and an unconditional branch), "
                                          f"got {self.cfg}")

    @property
    def world_size(self) -> int:
        return self.cfg * self.ulysses * self.tp * self.ep

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def dims(self) -> tuple[str, ...]:
        """The dimensions in use (degree > 1)."""
        return tuple(name for name in DIMENSIONS if getattr(self, name) > 1)

    def grid4(self, rank: int) -> tuple[int, int, int, int]:
        """``(cfg_rank, sp_rank, ep_rank, tp_rank)`` of global ``rank`` (ep sits between ulysses and tp)."""
        outer, tp_rank = divmod(rank, self.tp)
        outer, ep_rank = divmod(outer, self.ep)
        return outer // self.ulysses, outer % self.ulysses, ep_rank, tp_rank

    def grid(self, rank: int) -> tuple[int, int, int]:
        """``(cfg_rank, sp_rank, tp_rank)`` of global ``rank``."""
        c, sp, _, tp = self.grid4(rank)
        return c, sp, tp

    def rank_of(self, cfg_rank: int, sp_rank: int, tp_rank: int, ep_rank: int = 0) -> int:
        return ((cfg_rank * self.ulysses + sp_rank) * self.ep + ep_rank) * self.tp + tp_rank

    def coords(self, rank: int) -> tuple[int, int]:
        """``(cfg_rank, sp_rank)`` of global ``rank``."""
        return self.grid(rank)[:2]

    def cfg_peers(self, rank: int) -> list[int]:
        """The global ranks sharing ``rank``'s Ulysses and TP position (one per CFG branch)."""
        _, sp, ep, tp = self.grid4(rank)
        return [self.rank_of(c, sp, tp, ep) for c in range(self.cfg)]

    def ulysses_peers(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s Ulysses group (one CFG branch, one TP position)."""
        c, _, ep, tp = self.grid4(rank)
        return [self.rank_of(c, s, tp, ep) for s in range(self.ulysses)]

    def tp_peers(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s TP group (consecutive ranks)."""
        base = (rank // self.tp) * self.tp
        return list(range(base, base + self.tp))

    def ep_peers(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s expert-parallel group (same position in every other dimension)."""
        c, sp, _, tp = self.grid4(rank)
        return [self.rank_of(c, sp, tp, e) for e in range(self.ep)]

    def __str__(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in DIMENSIONS if getattr(self, name) > 1) or "none"

    @classmethod
    def parse(cls, value: object) -> ParallelConfig:
        """``None`` / ``""`` / ``"none"`` -> no parallelism; ``"cfg=2,ulysses=2,tp=2"``; a mapping; a config."""
        if value is None or isinstance(value, ParallelConfig):
            return value if value is not None else cls()
        if isinstance(value, Mapping):
            unknown = sorted(set(value) - set(DIMENSIONS))
            if unknown:
                raise ConfigError("parallel", f"unknown dimension {unknown[0]!r} (known: {', '.join(DIMENSIONS)})")
            return cls(**{k: int(v) for k, v in value.items()})
        if not isinstance(value, str):
            raise ConfigError("parallel", f"expected 'cfg=2,ulysses=2', got {value!r}")
        text = value.strip().lower()
        if text in ("", "none", "off"):
            return cls()
        degrees: dict[str, int] = {}
        for item in text.split(","):
            name, sep, number = item.strip().partition("=")
            name = name.strip()
            if not sep or name not in DIMENSIONS:
                raise ConfigError("parallel", f"{item.strip()!r} is not DIM=N with DIM one of {', '.join(DIMENSIONS)}")
            if name in degrees:
                raise ConfigError("parallel", f"{name} given twice")
            try:
                degrees[name] = int(number)
            except ValueError:
                raise ConfigError("parallel", f"{name} needs an integer degree, got {number.strip()!r}") from None
        return cls(**degrees)


__all__ = ["DIMENSIONS", "ParallelConfig"]
