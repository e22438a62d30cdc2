"""The CPU platform: always available, lowest priority, fp32 by default."""

from __future__ import annotations

import resource
import sys

from .base import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    def max_memory_allocated(self) -> int:
        """Peak resident set size of the process (the closest CPU analogue of a device peak)."""
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024
