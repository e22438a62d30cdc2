"""The platform ops seam (``omnicore.ops``) as this DiT uses it.

The model calls ``ops.rms_norm``, ``ops.modulate``, ``ops.gated_residual``, ``ops.gated_residual_norm_modulate``,
``ops.rope_rotate_half`` and ``ops.swiglu`` on the op table it was built with (``options.platform.ops``); without
one, the core's eager references.
"""

from __future__ import annotations

from typing import Any

REQUIRED = ("rms_norm", "modulate", "gated_residual", "gated_residual_norm_modulate", "rope_rotate_half", "swiglu")


def resolve_ops(ops: Any = None) -> Any:
    """``ops`` if given (it must provide every op in :data:`REQUIRED`), else the core's eager references
    (``omnicore.plugin.ops``)."""
    if ops is None:
        from omnicore.plugin import ops as eager

        ops = eager
    missing = [name for name in REQUIRED if not callable(getattr(ops, name, None))]
    if missing:
        raise TypeError(f"platform ops object lacks {missing}")
    return ops
