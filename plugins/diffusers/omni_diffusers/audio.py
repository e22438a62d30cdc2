"""Audio that a diffusers video pipeline returns beside its frames (LTX-2, Kandinsky 6 TI2VA): handed to
omnicore's :class:`Output` as float32 ``[channels, samples]`` at the pipeline's own rate (nothing is resampled).

Audio-only pipelines (Stable Audio, AudioLDM 2) are not served: omnicore's outputs are images and videos (with
sound); they are left to their own tooling. Which video pipelines carry audio is read from the output dataclass
their module defines (a field named ``audio``), not from a list of class names, so a new pipeline is found too.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np

#: where pipelines keep their output sample rate, first match wins: (attribute path on the pipeline)
RATE_ATTRIBUTES: tuple[tuple[str, ...], ...] = (
    ("vocoder", "config", "output_sampling_rate"),  # LTX-2: the vocoder's output (its mel rate differs)
    ("audio_sample_rate",),  # Kandinsky 6 TI2VA
    ("audio_sampling_rate",),
    ("vocoder", "config", "sampling_rate"),
    ("audio_vae", "config", "sample_rate"),
)


def returns_audio(pipeline_class: type) -> bool:
    """Whether the module defining ``pipeline_class`` (or the package it lives in) declares an output dataclass
    with an ``audio`` field (diffusers keeps each pipeline's output class in ``pipeline_output.py`` beside it)."""
    module_name = pipeline_class.__module__
    candidates = [module_name, module_name.rsplit(".", 1)[0] + ".pipeline_output"]
    for name in candidates:
        module = sys.modules.get(name)
        if module is None:
            continue
        for value in vars(module).values():
            if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__name__.endswith("Output") \
                    and any(f.name == "audio" for f in dataclasses.fields(value)):
                return True
    return False


def sample_rate(pipe: Any) -> int | None:
    """The pipeline's output sample rate (Hz), from the first of :data:`RATE_ATTRIBUTES` it has."""
    for path in RATE_ATTRIBUTES:
        obj: Any = pipe
        for part in path:
            obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, (int, float)) and not isinstance(obj, bool) and obj > 0:
            return int(obj)
    return None


def audio_rows(result: Any, rows: int) -> list[np.ndarray | None]:
    """Per output row, the waveform of ``result.audio`` as float32 ``[channels, samples]`` clipped to [-1, 1]
    (a ``[batch, samples]`` or ``[batch, channels, samples]`` tensor or array); ``None`` rows when the pipeline
    returned no audio (or only latents, ``output_type="latent"``)."""
    audio = getattr(result, "audio", None)
    if audio is None:
        return [None] * rows
    if hasattr(audio, "detach"):
        audio = audio.detach().float().cpu().numpy()
    array = np.asarray(audio, dtype=np.float32)
    if array.ndim == 2:  # [batch, samples]: mono
        array = array[:, None, :]
    if array.ndim != 3 or array.shape[0] != rows:
        raise ValueError(f"the pipeline returned audio of shape {tuple(array.shape)} for {rows} outputs; expected "
                         f"[batch, samples] or [batch, channels, samples]")
    return [np.clip(row, -1.0, 1.0) for row in array]


__all__ = ["RATE_ATTRIBUTES", "audio_rows", "returns_audio", "sample_rate"]
