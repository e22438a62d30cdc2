"""Platform ops: named kernels with eager references in the core, faster versions from backend plugins.

A model calls an op through the platform it was loaded with — ``options.platform.ops.rms_norm(x, w, eps)`` —
and never imports a backend. A backend plugin registers an :class:`~omnicore.specs.OpSpec` per op and platform
through the ``omnicore_register_ops`` hook; its ``applies`` predicate decides per call whether the fast kernel
handles the inputs, otherwise the eager reference (:mod:`omnicore.ops.reference`) runs.

Importing this package does not import torch: the references are loaded on first use.
"""

from __future__ import annotations

from typing import Any

from .._lazy import lazy_getattr
from .names import OP_NAMES

_LAZY = {
    "OpSpec": "omnicore.specs:OpSpec",
    "PlatformOps": "omnicore.ops.table:PlatformOps",
    **{name: f"omnicore.ops.reference:{name}" for name in OP_NAMES},
}


_lazy_attr = lazy_getattr(__name__, _LAZY)


def __getattr__(name: str) -> Any:
    return _lazy_attr(name)


__all__ = [  # noqa: RUF022 - grouped: names, records, then the ops in OP_NAMES order
    "OP_NAMES", "OpSpec", "PlatformOps", "rms_norm", "modulate", "gated_residual", "gated_residual_norm_modulate",
    "rope_rotate_half", "group_norm_silu", "rms_norm_silu", "swiglu", "upsample2x_conv",
    "lora_segment_delta",
]
assert set(__all__) == {"OP_NAMES", *_LAZY}
