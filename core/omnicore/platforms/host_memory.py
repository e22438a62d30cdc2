"""The process's host memory as Linux reports it (``/proc/self/status``): resident set now and its high-water mark.

``VmHWM`` is the peak resident set size since the process started or since the mark was last reset (writing ``5``
to ``/proc/self/clear_refs``). The CPU platform opens a peak window per batch with it; a parallel engine reads it on
every rank at the end of the load (:class:`HostMemory`), which is what "each rank loads only its shard, with no full
copy in host memory" is measured by. Elsewhere (no ``/proc``) every value is ``None``.
"""

from __future__ import annotations

import attrs


def status_bytes(key: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (``None`` when absent)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset the process's resident-set high-water mark to its current RSS; whether that was possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return False
    return status_bytes("VmHWM") is not None


@attrs.frozen
class HostMemory:
    """One process's host memory at a point: ``peak_rss_bytes`` (``VmHWM``: the most it has held since it
    started or since :func:`reset_peak_rss`) and ``rss_bytes`` (``VmRSS``: what it holds now); ``None`` where the
    platform does not say."""

    peak_rss_bytes: int | None
    rss_bytes: int | None

    @classmethod
    def now(cls) -> HostMemory:
        return cls(status_bytes("VmHWM"), status_bytes("VmRSS"))

    def as_dict(self) -> dict[str, int | None]:
        return {"peak_rss_bytes": self.peak_rss_bytes, "rss_bytes": self.rss_bytes}


__all__ = ["HostMemory", "reset_peak_rss", "status_bytes"]
