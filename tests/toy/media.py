"""``toy-media``: the toy model declaring conditioning roles, deployment options and preset defaults.

Test-only. Roles: ``reference`` (image, video or audio; up to 3; video/audio at most 2 s — the default role of
every kind), ``first_frame`` and ``last_frame`` (one image each), at most 4 inputs in total. Every input reaches
the model: images shift the conditioning by their brightness, videos by their mean frame brightness, audio by its
RMS level, and ``first_frame``/``last_frame`` add a role-specific offset, so a test can see that the media and
the role arrived. Options: ``conditioning_shift`` (float, added to the conditioning), ``variant`` (``base`` or
``large``, only recorded) and ``revise_prompt`` (bool: outputs carry ``"revised: <prompt>"`` as ``Output.text``).
A ``duration`` (s) without ``num_frames`` gives ``round(duration * fps)`` frames; ``quality="draft"`` halves the
default step count. The ``tiny:toy-media`` preset has small fast defaults and a fixed
default seed (1234).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import torch
from omnicore.engine.inputs import check_request
from omnicore.engine.protocol import DenoiseState
from omnicore.engine.request import GenerationRequest
from omnicore.specs import InputRole, ModelOption, PresetSpec, RequestDefaults

from .pipeline import ToyPipeline
from .plugin import TOY_SPEC

ROLE_OFFSET = {"first_frame": 0.25, "last_frame": -0.25}

TOY_MEDIA_PRESET_DEFAULTS = RequestDefaults(height=16, width=16, num_frames=1, fps=8.0, num_inference_steps=2,
                                            guidance_scale=1.0, flow_shift=None, seed=1234)

TOY_MEDIA_SPEC = attrs.evolve(
    TOY_SPEC,
    name="toy-media",
    impl="toy.media:ToyMediaPipeline",
    aliases=(),
    description="Test-only toy model with conditioning roles, options and preset defaults.",
    capabilities=attrs.evolve(
        TOY_SPEC.capabilities,
        modes=("t2i", "t2v", "i2i", "i2v"),
        inputs=(
            InputRole("reference", ("image", "video", "audio"), 3, "subject references", max_duration_s=2.0),
            InputRole("first_frame", ("image",), 1, "the first frame"),
            InputRole("last_frame", ("image",), 1, "the last frame"),
        ),
        max_inputs=4,
        fps_range=(1.0, 60.0),
        frame_rule="any",
    ),
    presets=(PresetSpec(name="toy-media", builder="toy.pipeline:build_tiny", description="toy with media roles",
                        defaults=TOY_MEDIA_PRESET_DEFAULTS),),
    options=(
        ModelOption("conditioning_shift", "float", 0.0, help="added to the conditioning vector"),
        ModelOption("variant", "str", "base", choices=("base", "large"), help="recorded only"),
        ModelOption("revise_prompt", "bool", False, help="outputs carry a revised prompt as text"),
    ),
)


class ToyMediaPipeline(ToyPipeline):
    """The toy pipeline taking every declared role; decodes video/audio in preprocess (once, at admission)."""

    def _load_images(self, images: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
        from omnicore.media import read_image_input

        return tuple(np.asarray(read_image_input(img, field=f"images[{i}]")) for i, img in enumerate(images))

    def preprocess(self, request: GenerationRequest) -> GenerationRequest:
        request = check_request(request, self.spec)  # idempotent: direct callers get roles filled too
        decoded = tuple(m if m.kind == "image" else attrs.evolve(m, data=m.load(field=f"inputs[{i}]"))
                        for i, m in enumerate(request.inputs))
        p = request.params
        if p.duration is not None and p.num_frames is None:  # a duration names the length in seconds
            fps = p.fps if p.fps is not None else self.spec.defaults.fps
            p = attrs.evolve(p, num_frames=max(1, round(p.duration * fps)))
        prepared = super().preprocess(request.evolve(inputs=decoded, params=p))
        if request.quality == "draft" and request.params.num_inference_steps is None:  # draft: half the steps
            steps = max(1, prepared.params.num_inference_steps // 2)
            prepared = prepared.evolve(params=attrs.evolve(prepared.params, num_inference_steps=steps))
        return prepared

    @torch.no_grad()
    def encode(self, requests: Sequence[GenerationRequest]) -> DenoiseState:
        state = super().encode(requests)  # images already shift the conditioning by their brightness
        text = state.extras["text"]
        shift = float((self.options.model_options if self.options else {}).get("conditioning_shift") or 0.0)
        for row, ri in enumerate(state.extras["owners"]):
            text[row] += shift
            for m in requests[ri].inputs:
                text[row] += ROLE_OFFSET.get(m.role or "", 0.0)
                if m.kind == "video":
                    text[row] += float(m.data.frames.astype(np.float32).mean()) / 127.5 - 1.0
                elif m.kind == "audio":
                    text[row] += float(np.sqrt(np.mean(np.square(m.data.waveform))))
        return state

    def decode(self, state: DenoiseState) -> list[Any]:
        outputs = super().decode(state)
        if (self.options.model_options if self.options else {}).get("revise_prompt"):
            owners = state.extras["owners"]
            for out, ri in zip(outputs, owners):
                out.text = f"revised: {state.requests[ri].prompt}"
        return outputs


# ------------------------------------------------------------------------------------ media files for tests


def write_png(path: Any, value: int = 128, size: tuple[int, int] = (16, 16)) -> Any:
    from PIL import Image

    Image.new("RGB", size, (value, value, value)).save(path, "PNG")
    return path


def write_mp4(path: Any, *, frames: int = 4, fps: float = 8.0, value: int = 200, size: int = 32,
              audio_seconds: float | None = None) -> Any:
    """A small H.264 MP4 (uniform grey frames), optionally with an AAC soundtrack (a 440 Hz tone)."""
    from omnicore.outputs.output import Output

    pixels = np.full((frames, size, size, 3), value, dtype=np.uint8)
    audio = None
    if audio_seconds is not None:
        t = np.arange(int(audio_seconds * 16000)) / 16000
        audio = np.stack([0.5 * np.sin(2 * np.pi * 440 * t)] * 2).astype(np.float32)
    Output(kind="video", frames=pixels, fps=fps, audio=audio, sample_rate=16000 if audio is not None else None
           ).save(path)
    return path


def write_wav(path: Any, *, seconds: float = 0.5, rate: int = 8000, amplitude: float = 0.5) -> Any:
    """A mono 16-bit PCM WAV of a 220 Hz tone."""
    import wave

    t = np.arange(int(seconds * rate)) / rate
    samples = (amplitude * np.sin(2 * np.pi * 220 * t) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return path
