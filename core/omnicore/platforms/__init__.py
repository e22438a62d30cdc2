"""Device platforms. The core ships :class:`~omnicore.platforms.cpu.CpuPlatform`; backends add others."""

from .base import Platform

__all__ = ["Platform"]
