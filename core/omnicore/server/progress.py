"""Job progress as the API reports it: one closed phase enumeration and weighted progress.

The engine emits its own phases (``preprocess`` at admission, then ``encode``, ``denoise``, ``decode``,
``postprocess``); this module maps them to the API's phases (both vocabularies live in :mod:`omnicore.phases`)
and turns them into ``phase_progress`` (the fraction done within the current phase, ``None`` where nothing is
known) and ``progress``, an integer 0-99 that is the weighted sum over phases. 100 is reserved for
``completed``, which only the job manager sets after the output is written.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..phases import API_PHASE_OF_ENGINE as _FROM_ENGINE
from ..phases import API_PHASES as PHASES

#: ``think`` takes its share from ``encode``: a job that writes no text passes both at the same progress
DEFAULT_WEIGHTS: Mapping[str, float] = {"preparing": 1, "preprocess": 4, "encode": 2, "think": 3, "denoise": 80,
                                        "decode": 7,
                                        "encode_output": 2, "finalize": 1}


def api_phase(engine_phase: str) -> str:
    """The API phase of an engine phase (terminal engine phases are not phases of the job record)."""
    return _FROM_ENGINE[engine_phase]


def phase_fraction(phase: str, step: int | None = None, total_steps: int | None = None) -> float | None:
    """Progress within ``phase``: steps done for ``denoise``, tokens for ``think``, 0 on entering any other phase."""
    if phase == "queued":
        return None
    if phase in ("denoise", "think"):  # think: tokens written of the budget
        return min(1.0, (step or 0) / total_steps) if total_steps else 0.0
    return 0.0


def weighted_progress(phase: str, fraction: float | None, weights: Mapping[str, float] = DEFAULT_WEIGHTS) -> int:
    """Percent done (0-99): the weights of the phases already passed plus this phase's weighted fraction."""
    if phase not in PHASES[1:]:
        return 0
    total = sum(weights.get(p, 0) for p in PHASES[1:]) or 1.0
    before = sum(weights.get(p, 0) for p in PHASES[1:PHASES.index(phase)])
    done = before + weights.get(phase, 0) * (fraction or 0.0)
    return max(0, min(99, int(100 * done / total)))
