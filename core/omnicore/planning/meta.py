"""Building real-size models on the meta device quickly, for ``omnicore plan``.

On the meta device a parameter has a shape and a dtype and no values, so the initialisers modules call while
they are constructed (``nn.init.kaiming_uniform_`` from every ``nn.Linear``, ``normal_`` ...) do nothing useful,
yet each one still dispatches through torch (hundreds of thousands of calls for an 80B-parameter model).
:func:`skipped_init` replaces ``torch.nn.init``'s in-place initialisers by the identity for the duration of a
block. It patches module-level functions, so it is only for a process doing nothing else at the time (the
``omnicore plan`` command), never around an engine that may be loading real weights on another thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


@contextmanager
def skipped_init() -> Iterator[None]:
    """``torch.nn.init.*_`` as no-ops inside the block (restored after, also on error)."""
    import torch.nn.init as init

    def keep(tensor: T, *args: object, **kwargs: object) -> T:
        return tensor

    names = [n for n in dir(init) if n.endswith("_") and not n.startswith("_") and callable(getattr(init, n))]
    saved = {n: getattr(init, n) for n in names}
    try:
        for n in names:
            setattr(init, n, keep)
        yield
    finally:
        for n, fn in saved.items():
            setattr(init, n, fn)


__all__ = ["skipped_init"]
