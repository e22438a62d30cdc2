"""Offload techniques: layer-wise (blocks visit the device one at a time, next one prefetched) and
model-level CPU offload. Parameters a cache owns are excluded by name prefix and stay resident."""

from .layerwise import (
    LayerwiseOffload,
    LayerwiseOffloadConfig,
    LayerwiseOffloadHook,
    apply_layerwise_offload,
    move_excluded,
)
from .model import ModelOffload, ModelOffloadConfig, apply_model_offload, materialize

__all__ = [
    "LayerwiseOffload", "LayerwiseOffloadConfig", "LayerwiseOffloadHook", "ModelOffload", "ModelOffloadConfig",
    "apply_layerwise_offload", "apply_model_offload", "materialize", "move_excluded",
]
