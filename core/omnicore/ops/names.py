"""The names of the platform ops (no torch import: specs validate against this list)."""

from __future__ import annotations

#: every op the core defines, each with an eager reference of the same name in :mod:`omnicore.ops.reference`
OP_NAMES: tuple[str, ...] = (
    "rms_norm",
    "modulate",
    "gated_residual",
    "gated_residual_norm_modulate",
    "rope_rotate_half",
    "group_norm_silu",
    "rms_norm_silu",
    "swiglu",
    "upsample2x_conv",
    "lora_segment_delta",
)
