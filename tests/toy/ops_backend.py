"""A test-only backend plugin that supplies platform ops (the kernel seam) for the CPU platform.

``rms_norm`` and ``swiglu`` "kernels" count their calls and compute the same values as the eager references by a
different formula (so they are real implementations, checked within tolerance, not aliases). ``rms_norm`` declares
itself applicable to 2-D inputs only (packed rows ``[T, H]``): per-head norms on ``[T, heads, D]`` fall back to the
eager reference, so one model run exercises both paths. ``CALLS`` records what ran.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from omnicore.hookspecs import hookimpl
from omnicore.specs import OpSpec

CALLS: Counter[str] = Counter()


def rms_norm_2d(x: Any, weight: Any, eps: float) -> Any:
    import torch

    CALLS["rms_norm.fast"] += 1
    xf = x.float()
    inv = torch.rsqrt((xf * xf).sum(dim=-1, keepdim=True) / xf.shape[-1] + eps)
    out = xf * inv
    return (out if weight is None else out * weight.float()).to(x.dtype)


def rms_norm_applies(x: Any, weight: Any, eps: float) -> bool:
    applies = x.dim() == 2
    CALLS["rms_norm.applies" if applies else "rms_norm.fallback"] += 1
    return applies


def swiglu(gate: Any, up: Any) -> Any:
    import torch

    CALLS["swiglu.fast"] += 1
    return gate * torch.sigmoid(gate) * up


class ToyOpsBackend:
    """Registers the toy kernels for ``platform`` (default ``cpu``) with ``priority``."""

    def __init__(self, platform: str = "cpu", priority: int = 10) -> None:
        self.platform = platform
        self.priority = priority

    @hookimpl
    def omnicore_register_ops(self, register: Callable[[OpSpec], None]) -> None:
        register(OpSpec(name="rms_norm", platform=self.platform, impl="toy.ops_backend:rms_norm_2d",
                        applies="toy.ops_backend:rms_norm_applies", priority=self.priority,
                        description="toy RMSNorm for packed [T, H] rows"))
        register(OpSpec(name="swiglu", platform=self.platform, impl="toy.ops_backend:swiglu",
                        priority=self.priority, description="toy SwiGLU"))
