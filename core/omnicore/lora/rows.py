"""How the rows an adapted linear sees map to the batch's samples (no torch import).

An adapted linear's input is ``[B, ..., in]`` with the sample on the leading dim (the default), or — inside a
model's :func:`packed_rows` scope — ``[T, in]`` rows of one packed sequence whose documents are the samples.
Forward sample ``j`` is output ``j % N`` of the batch's ``N`` outputs (``[cond ; uncond]`` CFG batches repeat the
outputs), unless the pipeline said otherwise with :func:`sample_rows` (a forward over a subset of the batch).
Both scopes are cheap context variables; they cost nothing when no adapter is active.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch


@attrs.frozen
class PackedRows:
    """``ends[j]``: cumulative end row of sample ``j``'s document in a packed sequence of ``num_rows`` rows
    (rows past ``ends[-1]`` are padding and get no adapter). ``window``: the rows ``[start, stop)`` of that
    sequence the linears see (a sequence-parallel rank's shard); ``None``: all of them."""

    ends: tuple[int, ...]
    num_rows: int
    window: tuple[int, int] | None = None

    @property
    def start(self) -> int:
        return 0 if self.window is None else self.window[0]

    @property
    def local_rows(self) -> int:
        """How many rows an adapted linear's input holds in this scope."""
        return self.num_rows if self.window is None else self.window[1] - self.window[0]


_PACKED: contextvars.ContextVar[PackedRows | None] = contextvars.ContextVar("omnicore_lora_packed", default=None)
_SAMPLES: contextvars.ContextVar[tuple[int, ...] | None] = contextvars.ContextVar("omnicore_lora_samples",
                                                                                     default=None)


_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("omnicore_lora_off", default=False)


def _ints(values: Any) -> tuple[int, ...]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    return tuple(int(v) for v in values)


@contextlib.contextmanager
def packed_rows(ends: Sequence[int] | torch.Tensor, num_rows: int, *, starts_at_zero: bool = True,
                window: tuple[int, int] | None = None) -> Iterator[None]:
    """Within this scope an adapted linear whose input is 2-D with ``num_rows`` rows reads them as a packed
    sequence: sample ``j`` covers rows ``[ends[j-1], ends[j])``. ``ends`` are host integers (a list, or a CPU
    tensor such as ``cu_seqlens[1:]``); ``starts_at_zero=False`` takes the full ``cu_seqlens`` (leading 0).
    ``window=(start, stop)``: the linears see only those rows of the sequence (a sequence-parallel rank's
    shard: its input has ``stop - start`` rows)."""
    values = _ints(ends)
    if not starts_at_zero:
        values = values[1:]
    if window is not None:
        start, stop = int(window[0]), int(window[1])
        if not 0 <= start <= stop <= int(num_rows):
            raise ValueError(f"packed_rows window {window} is not inside a sequence of {num_rows} rows")
        window = (start, stop)
    token = _PACKED.set(PackedRows(values, int(num_rows), window))
    try:
        yield
    finally:
        _PACKED.reset(token)


@contextlib.contextmanager
def sample_rows(outputs: Sequence[int] | torch.Tensor) -> Iterator[None]:
    """Within this scope forward sample ``j`` is the batch's output ``outputs[j]`` (a pipeline that runs a forward
    over a subset or a reordering of its batch says which outputs it holds)."""
    token = _SAMPLES.set(_ints(outputs))
    try:
        yield
    finally:
        _SAMPLES.reset(token)


#: the names ``omnicore.plugin`` exports them under
lora_packed_rows = packed_rows
lora_sample_rows = sample_rows


@contextlib.contextmanager
def base_only() -> Iterator[None]:
    """Within this scope no adapter applies (a stage a model runs on its base weights, e.g. a text stage whose
    rows do not map to the batch's samples)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def current_off() -> bool:
    return _OFF.get()


lora_base_only = base_only


def current_packed() -> PackedRows | None:
    return _PACKED.get()


def current_samples() -> tuple[int, ...] | None:
    return _SAMPLES.get()


__all__ = ["PackedRows", "base_only", "current_off", "current_packed", "current_samples", "lora_base_only",
           "lora_packed_rows", "lora_sample_rows", "packed_rows", "sample_rows"]
