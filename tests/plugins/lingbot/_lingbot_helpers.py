"""Helpers for the LingBot tests (imported by name; pytest puts this folder on sys.path)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omnicore.attention.reference import sdpa_attention
from omnicore.engine.protocol import LoadOptions
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.platforms.cpu import CpuPlatform


def load(path: Path, **options: Any) -> Any:
    from omni_lingbot.pipeline import LingBotPipeline

    return LingBotPipeline.from_pretrained(path, LoadOptions(platform=CpuPlatform(), **options))


def request(prompt: Any = "a red fox", *, images: Sequence[Any] = (), modalities: Any = ("video",),
            negative_prompt: str | None = None, extra: dict[str, Any] | None = None,
            **params: Any) -> GenerationRequest:
    """A small request (32x32, 5 frames, 3 steps, CFG 2) for the tiny preset; keywords override params."""
    defaults = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 3, "guidance_scale": 2.0,
                "seed": 7}
    if modalities == ("image",):
        defaults.pop("num_frames")
    return GenerationRequest(prompt, SamplingParams(**{**defaults, **params}), images=tuple(images),
                             modalities=modalities, negative_prompt=negative_prompt, extra=extra or {})


def run(pipe: Any, *requests: GenerationRequest) -> tuple[Any, list[Any]]:
    """Preprocess, encode, every step, decode: what the engine does for one batch."""
    prepared = [pipe.preprocess(r) for r in requests]
    state = pipe.encode(prepared)
    for step in range(state.num_steps):
        state = pipe.denoise_step(state, step)
    return state, pipe.decode(state)


#: Every call :func:`recording_attention` saw (cleared by the tests that read it).
ATTENTION_CALLS: list[dict[str, Any]] = []


def recording_attention(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    """An attention backend (lazy path ``_lingbot_helpers:recording_attention``) that records how it is called
    and answers with the core's SDPA reference."""
    ATTENTION_CALLS.append({"rows": q.shape[0], "keywords": sorted(kwargs),
                            "cu_seqlens": None if kwargs.get("metadata") is None
                            else list(kwargs["metadata"].cu_seqlens_q)})
    return sdpa_attention(q, k, v, **kwargs)


def unusable_attention(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("a backend that cannot serve packed documents was handed to the LingBot DiT")
