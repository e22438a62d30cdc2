"""The platform interface every backend implements: device, sync, memory queries, cache release, named ops."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ..ops.table import PlatformOps


class Platform:
    """Base class for device platforms; subclasses override what differs from the CPU behaviour."""

    name = "base"
    device_type = "cpu"
    _ops: PlatformOps | None = None

    @property
    def ops(self) -> PlatformOps:
        """The platform's op table (``platform.ops.rms_norm(x, w, eps)``; see :mod:`omnicore.ops`).

        The engine binds the table its plugin host built for this platform (fast kernels registered through
        ``omnicore_register_ops``); a platform used on its own has the eager references only.
        """
        if self._ops is None:
            from ..ops.table import PlatformOps

            self._ops = PlatformOps(self.name)
        return self._ops

    @ops.setter
    def ops(self, table: PlatformOps) -> None:
        self._ops = table

    def device(self, index: int = 0) -> torch.device:
        import torch

        return torch.device(self.device_type) if self.device_type == "cpu" else torch.device(self.device_type, index)

    def synchronize(self) -> None:
        """Wait for queued device work (no-op where execution is synchronous)."""

    def memory_allocated(self) -> int:
        """Bytes currently held by tensors on this device (0 when the platform cannot tell)."""
        return 0

    def max_memory_allocated(self) -> int | None:
        """Peak bytes since the last :meth:`reset_peak_memory`, or ``None`` when this platform cannot measure a
        window (never a number that means something else, e.g. a process-lifetime peak)."""
        return None

    def reset_peak_memory(self) -> None:
        """Start a new peak-memory window."""

    def empty_cache(self) -> None:
        """Give cached allocator blocks back to the device (after offloading weights)."""

    def dist_backend(self) -> str:
        """The ``torch.distributed`` backend of a worker group on this platform (``--parallel``): NCCL on CUDA,
        HCCL on Ascend NPUs, gloo elsewhere. A platform plugin overrides it when its collectives live elsewhere."""
        return {"cuda": "nccl", "npu": "hccl"}.get(self.device_type, "gloo")

    def default_dtype(self) -> torch.dtype:
        import torch

        return torch.float32
