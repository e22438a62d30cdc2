"""The platform ops seam (COORD interface D) as this DiT uses it.

The model calls ``ops.rms_norm``, ``ops.modulate``, ``ops.gated_residual``, ``ops.gated_residual_norm_modulate``,
``ops.rope_rotate_half`` and ``ops.swiglu`` on the object it was built with (``options.platform.ops``). Without one,
:func:`resolve_ops` falls back to ``omnicore.ops.reference`` and, on a core that does not ship the seam yet, to the
eager functions below (same names, signatures and math).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


def gated_residual(residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return residual + gate * update


def gated_residual_norm_modulate(residual: torch.Tensor, update: torch.Tensor, gate: torch.Tensor,
                                 shift: torch.Tensor, scale: torch.Tensor, eps: float, norm: str = "layer",
                                 weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    h = residual + gate * update
    if norm == "rms":
        n = rms_norm(h, weight, eps)
    elif norm == "layer":
        n = F.layer_norm(h.float(), h.shape[-1:], None if weight is None else weight.float(), None, eps).to(h.dtype)
    else:
        raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
    return h, n * (1 + scale) + shift


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    out = rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


_EAGER = SimpleNamespace(rms_norm=rms_norm, modulate=modulate, gated_residual=gated_residual,
                         gated_residual_norm_modulate=gated_residual_norm_modulate,
                         rope_rotate_half=rope_rotate_half, swiglu=swiglu)

REQUIRED = ("rms_norm", "modulate", "gated_residual", "gated_residual_norm_modulate", "rope_rotate_half", "swiglu")


def resolve_ops(ops: Any = None) -> Any:
    """``ops`` if given (it must provide every op in :data:`REQUIRED`), else the core reference ops."""
    if ops is None:
        try:
            from omnicore.ops import reference as ops  # type: ignore[no-redef]
        except ImportError:
            return _EAGER
    missing = [name for name in REQUIRED if not callable(getattr(ops, name, None))]
    if missing:
        raise TypeError(f"platform ops object lacks {missing}")
    return ops
