"""The ``try:`` requests ``omnicore serve`` prints once the model is ready: requests that work for *that* model.

A fixed example fails on models with required fields (MiniMax-H3's t2va needs an ``aspect_ratio``) or on a
checkpoint that serves only conditioned modes (the ref2va partition needs a reference). So the example is
derived from the spec: the first mode the deployment serves, the fields the spec declares required for it
(``ModelOption.required_for`` of ``ModelSpec.request_fields``, with their ``example`` value), and, for a mode
that needs conditioning media, a sample file written next to the server's state (the path is printed).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..server.translate import ServedModel
    from ..specs import InputRole, ModelSpec

#: role -> (HTTP field of ``POST /v1/videos``, media kind) for the roles an example can fill with an image
_IMAGE_FIELDS = {"first_frame": "input_reference", "last_frame": "last_frame", "reference": "reference_images"}
PROMPTS = {"image": "a red fox in the snow", "video": "a red fox running"}
SAMPLE_SIDE = 512  # a square sample image: inside every declared reference size and ratio range we ship


def _required_fields(spec: ModelSpec, mode: str) -> dict[str, object]:
    """The request fields the spec requires in ``mode``, with their example values."""
    out: dict[str, object] = {}
    for field in getattr(spec, "request_fields", ()):
        if mode in getattr(field, "required_for", ()):
            value = field.example if field.example is not None else (field.choices or (None,))[0]
            if value is not None:
                out[field.name] = value
    return out


def _mode_needs(spec: ModelSpec, mode: str) -> InputRole | None:
    """The input role a conditioned ``mode`` is served through (the first role declaring it), or ``None``."""
    if mode.startswith("t2"):
        return None
    return next((r for r in spec.capabilities.input_roles() if mode in r.modes and "image" in r.kinds), None)


def sample_image(folder: Path) -> Path:
    """A plain square PNG to condition an example request on (written once)."""
    from PIL import Image

    path = folder / "example-input.png"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        img = Image.new("RGB", (SAMPLE_SIDE, SAMPLE_SIDE), (180, 90, 40))
        img.paste((40, 90, 180), (SAMPLE_SIDE // 4, SAMPLE_SIDE // 4, 3 * SAMPLE_SIDE // 4, 3 * SAMPLE_SIDE // 4))
        img.save(path)
    return path


def example_commands(base: str, api_key: bool, served: ServedModel, folder: Path,
                     modes: tuple[str, ...] | None = None) -> str:
    """curl commands for ``served`` (a :class:`~omnicore.server.translate.ServedModel`), one per route it
    serves. ``modes``: what the loaded checkpoint serves (a preset's ``modes``), default all the spec's."""
    spec = served.spec
    assert spec is not None  # (the served model of a loaded engine)
    served_modes = tuple(modes or spec.capabilities.modes)
    auth = ' -H "Authorization: Bearer $OMNICORE_API_KEY"' if api_key else ""
    lines = []
    if "image.generate" in served.tasks:
        mode = next((m for m in served_modes if m.startswith("t2")), served_modes[0] if served_modes else "t2i")
        body: dict[str, Any] = {"prompt": PROMPTS["image"], "num_inference_steps": 4}
        extra = _required_fields(spec, mode)
        if extra:
            body["model_params"] = extra
        if _mode_needs(spec, mode) is None:
            lines.append(f"curl -s {base}/v1/images/generations{auth} -H 'Content-Type: application/json' "
                         f"-d {shlex.quote(json.dumps(body))}")
    if "video.generate" in served.tasks:
        video_modes = [m for m in served_modes if m.endswith(("v", "va"))] or list(served_modes)
        mode = video_modes[0] if video_modes else "t2v"
        parts = [f"-F prompt={shlex.quote(PROMPTS['video'])}", "-F num_inference_steps=4"]
        parts += [f"-F {shlex.quote(f'model_params[{k}]={v}')}" for k, v in _required_fields(spec, mode).items()]
        role = _mode_needs(spec, mode)
        if role is not None and role.role in _IMAGE_FIELDS:
            parts.append(f"-F {_IMAGE_FIELDS[role.role]}=@{shlex.quote(str(sample_image(folder)))}")
        lines.append(f"curl -s {base}/v1/videos{auth} {' '.join(parts)}")
    return "\n  ".join(lines)
