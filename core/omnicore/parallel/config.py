"""``--parallel cfg=2,ulysses=2``: the parallel degrees of one engine and the rank layout they imply.

Ranks form a ``cfg x ulysses`` grid, ulysses fastest: rank ``r`` has ``cfg_rank = r // ulysses`` and
``sp_rank = r % ulysses``, so the ranks of one CFG branch are neighbours (on one node, the all-to-alls of a
Ulysses group stay on the fastest links while the CFG exchange, once per step, crosses the slower ones).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..errors import ConfigError

DIMENSIONS = ("cfg", "ulysses")


@attrs.frozen
class ParallelConfig:
    """Degrees per dimension; ``cfg`` is 1 or 2 (the two guidance branches), ``ulysses`` any positive int."""

    cfg: int = 1
    ulysses: int = 1

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
        return self.cfg * self.ulysses

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def dims(self) -> tuple[str, ...]:
        """The dimensions in use (degree > 1)."""
        return tuple(name for name in DIMENSIONS if getattr(self, name) > 1)

    def coords(self, rank: int) -> tuple[int, int]:
        """``(cfg_rank, sp_rank)`` of global ``rank``."""
        return rank // self.ulysses, rank % self.ulysses

    def cfg_peers(self, rank: int) -> list[int]:
        """The global ranks sharing ``rank``'s Ulysses position (one per CFG branch)."""
        sp = rank % self.ulysses
        return [c * self.ulysses + sp for c in range(self.cfg)]

    def ulysses_peers(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s Ulysses group (one CFG branch)."""
        base = (rank // self.ulysses) * self.ulysses
        return list(range(base, base + self.ulysses))

    def __str__(self) -> str:
        return ",".join(f"{name}={getattr(self, name)}" for name in DIMENSIONS if getattr(self, name) > 1) or "none"

    @classmethod
    def parse(cls, value: Any) -> ParallelConfig:
        """``None`` / ``""`` / ``"none"`` -> no parallelism; ``"cfg=2,ulysses=2"``; a mapping; a config."""
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
