"""The CPU platform: always available, lowest priority, fp32 by default."""

from __future__ import annotations

from .base import Platform
from .host_memory import reset_peak_rss
from .host_memory import status_bytes as _status_bytes


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"

    _window_open = False

    def memory_allocated(self) -> int:
        """The process's resident set size now (``VmRSS``; 0 where ``/proc`` is missing)."""
        return _status_bytes("VmRSS") or 0

    def reset_peak_memory(self) -> None:
        """Start a peak window: reset the kernel's resident-set high-water mark to the current RSS (Linux
        ``/proc/self/clear_refs`` value 5). Where that is impossible the window stays closed and
        :meth:`max_memory_allocated` says ``None``."""
        self._window_open = reset_peak_rss()

    def max_memory_allocated(self) -> int | None:
        """The process's peak resident set size since :meth:`reset_peak_memory` (``VmHWM``: weights, activations
        and anything else the process held while the batch ran), or ``None`` without a window. The engine opens
        a window per batch, so this is the batch's peak, not the process lifetime's ``ru_maxrss``."""
        return _status_bytes("VmHWM") if self._window_open else None

