"""Cancellation points inside a stage (VAE decode chunks or tiles, long encodes).

The runner checks cancellation between denoise steps by itself. A stage that runs as one pipeline call
(``decode``) can take long for a video, so the runner opens a :func:`cancel_scope` around it and the
pipeline calls :func:`raise_if_cancelled` between its chunks, or wraps the module it calls once per chunk
with :func:`cancel_points` (a forward pre-hook, so diffusers' frame-by-frame decoders get a check per
chunk without any change to their code). When every request of the batch asked to stop, the check raises
:class:`~omnicore.errors.Cancelled` and the runner reports the jobs ``cancelled``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

from ..errors import Cancelled

if TYPE_CHECKING:
    from torch import nn

_CHECK: ContextVar[Callable[[], bool] | None] = ContextVar("omnicore_cancel_check", default=None)


def raise_if_cancelled() -> None:
    """Raise :class:`Cancelled` when the running batch's requests have all been cancelled; else nothing.

    Outside a runner's scope (a pipeline called directly) it never raises.
    """
    check = _CHECK.get()
    if check is not None and check():
        raise Cancelled("batch")


@contextmanager
def cancel_scope(check: Callable[[], bool]) -> Iterator[None]:
    """Make :func:`raise_if_cancelled` consult ``check`` inside the block (the runner's side)."""
    token = _CHECK.set(check)
    try:
        yield
    finally:
        _CHECK.reset(token)


@contextmanager
def cancel_points(*modules: nn.Module) -> Iterator[None]:
    """Check cancellation before every forward call of ``modules`` (``torch.nn.Module``) inside the block."""
    handles = [m.register_forward_pre_hook(lambda _module, _args: raise_if_cancelled()) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
