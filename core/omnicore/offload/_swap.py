"""Parameter storage swapping shared by the offload techniques.

A :class:`ParamSet` holds a fixed list of parameters with a host copy of each. ``release()`` replaces each
parameter's data with a zero-element tensor of the same dtype on the compute device (the parameter object
and its device survive, its storage is freed); ``load()`` copies the host copies back. Parameters are
inference-constant, so nothing is copied back to the host on release.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def is_distributed(p: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(p, DTensor) or isinstance(getattr(p, "data", None), DTensor)


def excluded_by(name: str, prefixes: Sequence[str], *, anywhere: bool = False) -> bool:
    """``name`` starts with one of ``prefixes`` (or, with ``anywhere``, has one at a dotted boundary)."""
    if anywhere:
        dotted = "." + name
        return any(dotted.startswith("." + p) or ("." + p) in dotted for p in prefixes)
    return any(name.startswith(p) for p in prefixes)


def side_stream(device: torch.device) -> torch.Stream | None:
    """A copy stream on ``device`` where the platform has streams (CUDA-like), else ``None``."""
    if device.type in ("cpu", "meta"):
        return None
    module = getattr(torch, device.type, None)
    stream_cls = getattr(module, "Stream", None)
    if stream_cls is None:
        return None
    try:
        return stream_cls(device)
    except Exception:  # pragma: no cover - platform without usable streams
        return None


class ParamSet:
    """Owned parameters of one module (names relative to it) with host copies for swapping."""

    def __init__(self, module: nn.Module, device: torch.device, excluded: Sequence[str] = (), *,
                 anywhere: bool = False, pin: bool | None = None) -> None:
        self.device = device
        self.params: dict[str, nn.Parameter] = {}
        self.host: dict[str, torch.Tensor] = {}
        pin = device.type == "cuda" if pin is None else pin
        for name, p in module.named_parameters():
            if excluded_by(name, excluded, anywhere=anywhere) or is_distributed(p) or p.device.type == "meta":
                continue
            host = p.detach().to("cpu", copy=True)
            if pin:
                host = host.pin_memory()
            self.params[name] = p
            self.host[name] = host
        self.loaded = all(p.numel() > 0 and p.device == device for p in self.params.values())
        self.event: torch.Event | None = None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self.params)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())

    def load(self, stream: torch.Stream | None = None, non_blocking: bool = False) -> None:
        if self.loaded:
            return
        if stream is not None:
            with getattr(torch, self.device.type).stream(stream):
                for name, p in self.params.items():
                    p.data = self.host[name].to(self.device, non_blocking=True)
                self.event = stream.record_event()
        else:
            for name, p in self.params.items():
                p.data = self.host[name].to(self.device, non_blocking=non_blocking)
        self.loaded = True

    def wait(self) -> None:
        """Make the current stream wait for a prefetch issued on a side stream."""
        if self.event is not None:
            current = getattr(torch, self.device.type).current_stream(self.device)
            current.wait_event(self.event)
            for p in self.params.values():  # allocated on the side stream, used (and freed) on this one
                p.data.record_stream(current)
            self.event = None

    def release(self) -> None:
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=self.device)
        self.loaded = False
        self.event = None

    def restore_resident(self) -> None:
        """Undo the offload for good: every parameter back on the device with its values."""
        self.loaded = False
        self.load()
