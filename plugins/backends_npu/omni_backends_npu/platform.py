"""The ``npu`` platform: device, synchronisation, memory statistics, streams and events through ``torch.npu``.

``torch.npu`` only exists once ``torch_npu`` is imported; this module imports it on first use (the platform is
only instantiated when the probe found a device), so the module itself imports on any machine.
"""

from __future__ import annotations

from typing import Any

import torch
from omnicore.plugin import Platform


def _npu() -> Any:
    """``torch.npu`` (imports torch_npu, which registers it)."""
    import torch_npu  # noqa: F401

    return torch.npu  # type: ignore[attr-defined]


class NpuPlatform(Platform):
    """Ascend NPUs through torch_npu (selected automatically over the CPU when the probe passes)."""

    name = "npu"
    device_type = "npu"

    def device(self, index: int = 0) -> torch.device:
        return torch.device("npu", index)

    def synchronize(self) -> None:
        _npu().synchronize()

    def memory_allocated(self) -> int:
        return int(_npu().memory_allocated())

    def max_memory_allocated(self) -> int | None:
        """Peak bytes held by tensors since :meth:`reset_peak_memory` (the caching allocator's window)."""
        return int(_npu().max_memory_allocated())

    def reset_peak_memory(self) -> None:
        _npu().reset_peak_memory_stats()

    def empty_cache(self) -> None:
        _npu().empty_cache()

    def default_dtype(self) -> torch.dtype:
        """bf16: what the Ascend attention kernels (and MindIE-SD's laser path) are built for."""
        return torch.bfloat16

    # ------------------------------------------------------------------ services for offload and benchmarks
    def memory_stats(self) -> dict[str, int]:
        npu = _npu()
        free, total = npu.mem_get_info()
        return {"allocated": int(npu.memory_allocated()), "reserved": int(npu.memory_reserved()),
                "max_allocated": int(npu.max_memory_allocated()), "free": int(free), "total": int(total)}

    def stream(self, index: int = 0) -> Any:
        """A new side stream (weight prefetch overlapping compute)."""
        return _npu().Stream(device=self.device(index))

    def current_stream(self, index: int = 0) -> Any:
        return _npu().current_stream(self.device(index))

    def event(self, *, timing: bool = False) -> Any:
        """An event to order streams (``stream.wait_event``) or, with ``timing``, to time device work."""
        return _npu().Event(enable_timing=timing)

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        """A page-locked host copy of ``tensor`` (asynchronous host-to-device copies need one)."""
        return tensor if tensor.is_pinned() else tensor.pin_memory()
