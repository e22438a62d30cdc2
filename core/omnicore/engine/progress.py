"""Typed progress events. ``progress`` is a 0..1 fraction that never decreases within a job."""

from __future__ import annotations

import attrs

from ..phases import ENGINE_PHASES as PHASES
from ..phases import TERMINAL_PHASES

__all__ = ["DENOISE_END", "DENOISE_START", "PHASES", "TERMINAL_PHASES", "ProgressEvent", "phase_progress"]

# Where each phase starts on the 0..1 scale; denoise spans [DENOISE_START, DENOISE_END] by step.
_PHASE_START = {"preprocess": 0.0, "queued": 0.0, "encode": 0.02, "think": 0.03, "denoise": 0.05, "decode": 0.9,
                "postprocess": 0.95, "done": 1.0}
DENOISE_START, DENOISE_END = 0.05, 0.9
THINK_START, THINK_END = 0.03, DENOISE_START


def _check_phase(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value not in PHASES:
        raise ValueError(f"ProgressEvent.phase must be one of {PHASES}, got {value!r}")


@attrs.frozen
class ProgressEvent:
    """One observation of a job: ``phase``, denoise ``step`` of ``total_steps`` (0 before the first step; in
    ``think``, the tokens the model has written of its budget),
    seconds since the job was created, the estimated seconds left (``None`` until a step has been timed),
    and the overall fraction done."""

    job_id: str
    phase: str = attrs.field(validator=_check_phase)
    step: int = 0
    total_steps: int = 0
    elapsed_s: float = 0.0
    eta_s: float | None = None
    progress: float = 0.0
    message: str | None = None  # the error text for "failed"

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES


def phase_progress(phase: str, step: int = 0, total_steps: int = 0) -> float:
    """The nominal fraction done at ``phase`` (terminal non-success phases keep the last value: -1 here)."""
    if phase == "denoise":
        frac = step / total_steps if total_steps else 0.0
        return DENOISE_START + (DENOISE_END - DENOISE_START) * frac
    if phase == "think":  # step = tokens written, total_steps = the token budget
        frac = min(1.0, step / total_steps) if total_steps else 0.0
        return THINK_START + (THINK_END - THINK_START) * frac
    return _PHASE_START.get(phase, -1.0)
