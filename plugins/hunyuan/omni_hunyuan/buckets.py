"""Resolution buckets: the ratio group a generated image is snapped to; bucket ``i`` is the
``<img_ratio_i>`` token.

From ``base x base`` the height grows and the width shrinks by ``step`` (default ``base // 16``) until
``2*base x base/2``, and the reverse; the list is sorted by height/width. A base of 1024 gives 33 buckets.
Instruct checkpoints append extra buckets (ids 33..36) whose ratio is not already present.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

#: Instruct extras at base 1024 (height, width); scaled with the base for other bases.
INSTRUCT_EXTRAS_1024 = ((768, 1024), (720, 1280), (1024, 768), (1280, 720))


@attrs.frozen
class Bucket:
    index: int
    height: int
    width: int

    @property
    def ratio(self) -> float:
        return self.height / self.width


class ResolutionGroup:
    """The buckets of one base size."""

    def __init__(self, base_size: int, step: int | None = None,
                 extras: Sequence[tuple[int, int]] = ()) -> None:
        if base_size < 2 or base_size % 2:
            raise ValueError(f"base_size must be an even positive integer, got {base_size}")
        step = base_size // 16 if step is None else step
        if not 0 < step <= base_size // 2:
            raise ValueError(f"step must be in (0, base_size // 2], got {step}")
        self.base_size = base_size
        self.step = step
        sizes = [(base_size, base_size)]
        for grow_height in (True, False):
            h = w = base_size
            while True:
                if grow_height:
                    if h >= 2 * base_size and w <= base_size // 2:
                        break
                    h, w = min(h + step, 2 * base_size), max(w - step, base_size // 2)
                else:
                    if h <= base_size // 2 and w >= 2 * base_size:
                        break
                    h, w = max(h - step, base_size // 2), min(w + step, 2 * base_size)
                sizes.append((h, w))
        sizes.sort(key=lambda hw: hw[0] / hw[1])
        for h, w in extras:
            if not any(h / w == a / b for a, b in sizes):
                sizes.append((h, w))
        self.buckets = tuple(Bucket(i, h, w) for i, (h, w) in enumerate(sizes))

    def __len__(self) -> int:
        return len(self.buckets)

    @property
    def ratio_range(self) -> tuple[float, float]:
        ratios = [b.ratio for b in self.buckets]
        return min(ratios), max(ratios)

    def nearest(self, height: int, width: int) -> Bucket:
        """The bucket whose height/width ratio is closest (first one on ties, like ``argmin``)."""
        ratio = height / width
        return min(self.buckets, key=lambda b: (abs(b.ratio - ratio), b.index))


def instruct_extras(base_size: int) -> tuple[tuple[int, int], ...]:
    """The Instruct extra buckets scaled to ``base_size`` (rounded to multiples of 16)."""
    def scale(v: int) -> int:
        return max(16, round(v * base_size / 1024 / 16) * 16)
    return tuple((scale(h), scale(w)) for h, w in INSTRUCT_EXTRAS_1024)
