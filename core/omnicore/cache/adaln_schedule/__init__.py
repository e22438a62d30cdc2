"""Exact-schedule AdaLN modulation cache: keys, the projection module, the model-level controller and the
``adaln_schedule`` cache method (see each module)."""

from .controller import ABSENT, AdaLNScheduleCache, AdaLNScheduleController
from .keys import ScheduleKey, StepTimesteps, float32_bits, schedule_key, step_timesteps
from .method import (
    METHOD_NAME,
    STATE_CACHE_KEY,
    STATE_STEP_KEY,
    AdaLNScheduleConfig,
    AdaLNScheduleHandle,
    apply_adaln_schedule,
    resident_modules,
)
from .projection import AdaLNProjection

EXCLUDED_OFFLOAD_PREFIXES: tuple[str, ...] = ("adaln_proj.linear.",)
"""Block-relative parameter prefixes a layer-wise offload must leave alone while this cache owns them."""

__all__ = [
    "ABSENT", "EXCLUDED_OFFLOAD_PREFIXES", "METHOD_NAME", "STATE_CACHE_KEY", "STATE_STEP_KEY",
    "AdaLNProjection", "AdaLNScheduleCache", "AdaLNScheduleConfig", "AdaLNScheduleController",
    "AdaLNScheduleHandle", "ScheduleKey", "StepTimesteps", "apply_adaln_schedule", "float32_bits",
    "resident_modules", "schedule_key", "step_timesteps",
]
