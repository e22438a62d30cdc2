"""Helpers for the MiniMax-H3 pipeline tests (imported by name; pytest puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from omnicore.engine.protocol import LoadOptions
from omnicore.engine.request import GenerationRequest, MediaInput, SamplingParams
from omnicore.media import AudioClip
from omnicore.platforms.cpu import CpuPlatform
from PIL import Image

#: the tiny presets' own defaults (the pipeline's spec is the model's when loaded directly)
SMALL = {"num_inference_steps": 2, "seed": 7}


def load(path: Path, **options: Any) -> Any:
    from omni_minimax_h3.pipeline import MiniMaxH3Pipeline

    return MiniMaxH3Pipeline.from_pretrained(path, LoadOptions(platform=CpuPlatform(), **options))


def request(prompt: str = "rain on a tin roof", *, inputs: tuple[Any, ...] = (), extra: dict[str, Any] | None = None,
            **params: Any) -> GenerationRequest:
    """A small t2va-sized request (4 s, 2 steps, 16:9 unless ``extra`` says otherwise)."""
    extra = {"aspect_ratio": "16:9"} if extra is None else extra
    values = {**SMALL, "duration": 4.0, **params}
    return GenerationRequest(prompt, SamplingParams(**values), inputs=inputs, extra=extra)


def image(width: int = 96, height: int = 64, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def tone(seconds: float = 2.5, rate: int = 32000, channels: int = 2) -> AudioClip:
    t = np.arange(int(seconds * rate), dtype=np.float32) / rate
    wave = 0.3 * np.sin(2 * np.pi * 440.0 * t)
    return AudioClip(np.stack([wave] * channels).astype(np.float32), rate)


def keyframe(role: str, img: Image.Image) -> MediaInput:
    return MediaInput("image", role, img)


def reference(kind: str, data: Any) -> MediaInput:
    return MediaInput(kind, "reference", data)


def run(pipe: Any, *requests: GenerationRequest) -> tuple[Any, list[Any]]:
    """Preprocess, encode, every step, decode: what the engine does for one batch."""
    prepared = [pipe.preprocess(r) for r in requests]
    state = pipe.encode(prepared)
    for step in range(state.num_steps):
        state = pipe.denoise_step(state, step)
    return state, pipe.decode(state)
