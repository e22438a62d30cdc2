"""HTTP DTO -> ``GenerationRequest``: the thin edge.

Each HTTP field maps to exactly one field of the Python API. Everything knowable at submission time is
checked here or by the model's ``preprocess`` (which the engine runs at admission), so an accepted job
never fails later for a reason the client could have been told up front.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs

from ..engine.inputs import check_input_roles
from ..engine.request import QUALITIES, GenerationRequest, MediaInput, SamplingParams, random_seed
from ..errors import InvalidRequest
from ..sizes import parse_size_wh
from ..specs import InputRole, ModelCapabilities, ModelSpec, RequestDefaults
from .errors import ApiError
from .schemas import ImageGenerationRequest, SharedFields, VideoCreateRequest
from .settings import ServerSettings

NEUTRAL_FIELDS = ("style", "background", "moderation")

#: Video conditioning fields -> (media kind, role in the Python API).
VIDEO_MEDIA_FIELDS: dict[str, tuple[str, str]] = {
    "input_reference": ("image", "first_frame"),
    "last_frame": ("image", "last_frame"),
    "reference_images": ("image", "reference"),
    "reference_video": ("video", "reference"),
    "reference_audio": ("audio", "reference"),
}


@attrs.frozen
class ServedModel:
    """What the server tells clients about the one model it serves (``/v1/models``, validation)."""

    id: str
    names: tuple[str, ...]
    owned_by: str
    tasks: tuple[str, ...]
    max_outputs: int
    max_reference_images: int
    multiple_of: int | None
    audio: bool
    defaults: RequestDefaults
    created: int = 0
    spec: ModelSpec | None = None  # the served ModelSpec (roles, limits, options)
    model_options: dict[str, Any] = attrs.field(factory=dict)  # the values the engine loaded the model with
    loras: tuple[dict[str, object], ...] = ()  # its preloaded LoRA adapters (lora_http.adapter_cards)

    @classmethod
    def from_spec(cls, spec: ModelSpec, requested: str | None = None, created: int = 0,
                  model_options: dict[str, Any] | None = None) -> ServedModel:
        caps = spec.capabilities
        names = [spec.name, f"tiny:{spec.name}", *spec.aliases]
        if requested and requested not in names:
            names.append(requested)
        image_role = caps.default_role("image")
        max_images = image_role.max_count if image_role is not None else 0
        tasks = []
        if "image" in caps.outputs:
            tasks.append("image.generate")
            if max_images > 0 and any(m in caps.modes for m in ("i2i", "edit", "ti2i", "it2i")):
                tasks.append("image.edit")
        if "video" in caps.outputs:
            tasks.append("video.generate")
        return cls(
            id=spec.name, names=tuple(dict.fromkeys(names)), owned_by=spec.provider or "omnicore",
            tasks=tuple(tasks), max_outputs=min(10, caps.max_outputs_per_request),
            max_reference_images=max_images,
            multiple_of=getattr(caps, "size_multiple_of", None) or getattr(caps, "multiple_of", None),
            audio="audio" in caps.outputs, defaults=spec.defaults, created=created, spec=spec,
            model_options=dict(model_options or {}),
        )

    def role(self, name: str) -> InputRole | None:
        """The model's declared :class:`~omnicore.specs.InputRole` called ``name``, or ``None``."""
        caps = self.spec.capabilities if self.spec is not None else None
        return next((r for r in caps.input_roles() if r.role == name), None) if caps is not None else None

    def card(self, backend: str | None = None) -> dict[str, Any]:
        """The ``/v1/models`` entry: modes, input roles, size/fps/frame limits, options."""
        d = self.defaults
        caps = self.spec.capabilities if self.spec is not None else None
        roles = [r.to_json() for r in caps.input_roles()] if caps is not None else []
        options = [{**o.to_json(), "value": self.model_options.get(o.name, o.default)}
                   for o in (self.spec.options if self.spec is not None else ())]
        return {
            "id": self.id, "object": "model", "created": self.created, "owned_by": self.owned_by,
            "omnicore": {
                "aliases": [n for n in self.names if n != self.id], "tasks": list(self.tasks),
                "modes": list(caps.modes) if caps is not None else [],
                "plugin": self.owned_by, "backend": backend,
                "sizes": {"default": f"{d.width}x{d.height}", "multiple_of": self.multiple_of,
                          "max_pixels": getattr(caps, "max_pixels", None)},
                "video": {"default_fps": d.fps, "default_frames": d.num_frames, "audio": self.audio,
                          "fps_range": list(caps.fps_range) if caps is not None and caps.fps_range else None,
                          "frame_rule": getattr(caps, "frame_rule", None),
                          "max_frames": getattr(caps, "max_frames", None)},
                "defaults": {"num_inference_steps": d.num_inference_steps, "guidance_scale": d.guidance_scale,
                             "seed": getattr(d, "seed", None)},
                "inputs": {"roles": roles, "max_inputs": getattr(caps, "max_inputs", None),
                           "max_input_images": self.max_reference_images,
                           "supports_negative_prompt": True, "partial_images": False},
                "options": options,
                "model_params": [o.to_json() for o in getattr(self.spec, "request_fields", ())],
                "max_steps": getattr(caps, "max_steps", None),
                "max_outputs": self.max_outputs, "loras": list(self.loras),
            },
        }


def _bad(param: str, message: str, code: str = "invalid_value", status: int = 400) -> ApiError:
    return ApiError(status, code, message, param=param)


def request_size(size: str | None, param: str = "size") -> tuple[int, int] | None:
    """``"WxH"`` -> ``(width, height)`` (the core's one size parser, each side at least 16); ``"auto"``/``None``
    -> ``None`` (the model default)."""
    if size is None or size == "auto":
        return None
    try:
        return parse_size_wh(size, param, minimum=16)
    except InvalidRequest as exc:
        raise _bad(param, f"{param}: {exc.rule} ('auto': the model's default)") from None


def check_size(wh: tuple[int, int] | None, served: ServedModel, settings: ServerSettings,
               param: str = "size") -> None:
    if wh is None:
        return
    w, h = wh
    # (pixel and work limits are checked once, on the resolved request, by the engine: engine/limits.py)
    m = served.multiple_of
    if m and (w % m or h % m):
        def near(v: int) -> str:
            return f"{v - v % m} or {v - v % m + m}" if v % m else str(v)
        raise _bad(param, f"size {w}x{h} is not a multiple of {m} for model {served.id}; "
                          f"nearest widths {near(w)}, heights {near(h)}")


def _shared(dto: SharedFields, served: ServedModel, settings: ServerSettings, task: str) -> dict[str, Any]:
    if dto.model is not None and dto.model not in served.names:
        raise ApiError(404, "model_not_found", f"model {dto.model!r} is not served here; this server serves "
                                                f"{served.id!r} (aliases: {', '.join(served.names[1:]) or 'none'})",
                       param="model")
    if task not in served.tasks:
        raise ApiError(404, "task_not_supported", f"model {served.id} does not serve {task} "
                                                   f"(it serves: {', '.join(served.tasks) or 'nothing'})")
    for name in ("prompt", "negative_prompt"):
        text = getattr(dto, name)
        if text is not None and len(text) > settings.max_prompt_chars:
            raise _bad(name, f"{name} has {len(text)} characters, more than {settings.max_prompt_chars}",
                       code="prompt_too_long")
    if dto.model_params is not None and dto.extra_params is not None:
        raise _bad("extra_params", "give model_params or its alias extra_params, not both")
    # no seed: the model's default seed when it declares one (RequestDefaults.seed), else a random one
    default_seed = getattr(served.defaults, "seed", None)
    seed = dto.seed if dto.seed is not None else default_seed if default_seed is not None \
        else random_seed(getattr(dto, "n", 1))  # the engine's one seed range [0, MAX_SEED]
    from .lora_http import request_loras  # adapters are read and checked by the engine at submit

    return {"extra": dict(dto.model_params or dto.extra_params or {}), "seed": seed,
            "quality": parse_quality(getattr(dto, "quality", None)), "loras": request_loras(dto.lora)}


def parse_quality(value: str | None) -> str:
    """``quality``: ``draft``, ``standard`` or ``high`` (omnicore's tiers); ``auto``/null = ``standard``."""
    if value in (None, "auto"):
        return "standard"
    if value not in QUALITIES:
        raise _bad("quality", f"quality={value!r} is not supported; use one of {', '.join(QUALITIES)} or 'auto'",
                   code="unsupported_parameter")
    return value


def image_request(dto: ImageGenerationRequest, served: ServedModel, settings: ServerSettings, *, request_id: str,
                  images: tuple[object, ...] = (), task: str = "image.generate") -> GenerationRequest:
    common = _shared(dto, served, settings, task)
    if dto.response_format not in (None, "b64_json"):
        raise _bad("response_format", f"response_format {dto.response_format!r} is not supported; only 'b64_json'",
                   code="unsupported_parameter")
    for name in NEUTRAL_FIELDS:
        value = getattr(dto, name)
        if value not in (None, "auto"):
            raise _bad(name, f"{name}={value!r} is not implemented by omnicore; only 'auto' or null is accepted",
                       code="unsupported_parameter")
    if dto.output_compression is not None and dto.output_format == "png":
        raise _bad("output_compression", "output_compression is only allowed with output_format jpeg or webp")
    if dto.partial_images:
        if not dto.stream:
            raise _bad("partial_images", "partial_images needs stream: true")
        raise _bad("partial_images", f"model {served.id} does not produce partial images",
                   code="unsupported_for_model")
    if dto.n > served.max_outputs:
        raise _bad("n", f"n={dto.n} is more than model {served.id} produces per request ({served.max_outputs})")
    wh = request_size(dto.size)
    check_size(wh, served, settings)
    if len(images) > served.max_reference_images:
        raise _bad("image", f"{len(images)} input images; model {served.id} accepts at most "
                            f"{served.max_reference_images}", code="too_many_input_images")
    params = SamplingParams(
        width=wh[0] if wh else None, height=wh[1] if wh else None, num_frames=1,
        num_inference_steps=dto.num_inference_steps, guidance_scale=dto.guidance_scale, flow_shift=dto.flow_shift,
        seed=common["seed"], num_outputs=dto.n, output_type="image",
    )
    return GenerationRequest(prompt=dto.prompt, params=params, negative_prompt=dto.negative_prompt,
                             images=images, extra=common["extra"], request_id=request_id, quality=common["quality"],
                             loras=common["loras"])


def parse_seconds(value: int | str | None) -> float | None:
    if value is None:
        return None
    try:
        seconds = int(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        seconds = None
    if seconds is None or seconds < 1 or str(value).strip() != str(seconds):
        raise _bad("seconds", f"seconds must be a positive integer, got {value!r}")
    if seconds > 3600:
        raise _bad("seconds", f"seconds must be at most 3600, got {seconds}")
    return float(seconds)


def video_inputs(served: ServedModel, media: Sequence[tuple[str, object]]) -> tuple[MediaInput, ...]:
    """``(http field, data)`` pairs -> role-tagged inputs, checked by the engine's own rules
    (:func:`omnicore.engine.inputs.check_input_roles`, reading no media) with each error naming the field: a role
    the model lacks is 400 ``unsupported_for_model``, more than a role takes is 400 (``too_many_input_images`` for
    images). A model that declares no roles (only ``max_reference_images``) gets ``input_reference`` in its default
    image role."""
    caps = served.spec.capabilities if served.spec is not None else ModelCapabilities()
    inputs = []
    for field, data in media:
        kind, role_name = VIDEO_MEDIA_FIELDS[field]
        if (served.role(role_name) is None and not caps.inputs and field == "input_reference"
                and served.max_reference_images and (default := caps.default_role("image")) is not None):
            role_name = default.role
        inputs.append(MediaInput(kind, role_name, data))
    try:
        check_input_roles(inputs, caps, served.id, fields=[field for field, _ in media])
    except InvalidRequest as exc:
        raise _bad(exc.field, exc.rule, code=exc.code or "invalid_value") from None
    return tuple(inputs)


def video_request(dto: VideoCreateRequest, served: ServedModel, settings: ServerSettings, *, request_id: str,
                  images: tuple[object, ...] = (), media: Sequence[tuple[str, object]] = ()) -> GenerationRequest:
    """``media`` holds ``(field, data)`` for the conditioning fields (``images`` = ``input_reference`` data)."""
    common = _shared(dto, served, settings, "video.generate")
    inputs = video_inputs(served, [*(("input_reference", im) for im in images), *media])
    if dto.generate_audio and not served.audio:
        raise _bad("generate_audio", f"model {served.id} does not generate audio", code="unsupported_for_model")
    wh = request_size(dto.size)
    check_size(wh, served, settings)
    duration = parse_seconds(dto.seconds)
    num_frames = dto.num_frames
    if num_frames is None and duration is not None:
        # the frame count derived from `seconds` (the model rounds it up to its frame rule)
        fps = dto.fps if dto.fps is not None else served.defaults.fps
        num_frames = max(1, math.ceil(duration * fps - 1e-9))
    modalities = None
    if served.audio and dto.generate_audio is not None:
        modalities = ("video", "audio") if dto.generate_audio else ("video",)
    params = SamplingParams(
        width=wh[0] if wh else None, height=wh[1] if wh else None, num_frames=num_frames,
        fps=float(dto.fps) if dto.fps is not None else None, duration=duration,
        num_inference_steps=dto.num_inference_steps, guidance_scale=dto.guidance_scale, flow_shift=dto.flow_shift,
        seed=common["seed"], num_outputs=1, output_type="video",
    )
    return GenerationRequest(prompt=dto.prompt, params=params, negative_prompt=dto.negative_prompt,
                             inputs=inputs, modalities=modalities, extra=common["extra"], request_id=request_id,
                             quality=common["quality"], loras=common["loras"])
