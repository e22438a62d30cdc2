"""Request and response DTOs of the HTTP contract, as pydantic models.

Requests forbid unknown fields (400 ``unknown_parameter``) and take types strictly where pydantic's lax mode
would guess: a boolean is not a number (``"seed": true``) and ``"stream": "yes"`` is not a boolean. Ranges
here are the contract's shared limits; the model's own limits are checked at submission (see :mod:`.translate`).
Responses are declared for the OpenAPI document; routes build plain dicts that match them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from ..engine.request import MAX_SEED  # the one seed range
from ..json_types import JSON, JSONObject
from ..lora.records import MAX_LORA_SCALE
from ..lora.records import MAX_LORAS_PER_REQUEST as MAX_LORAS  # the engine's bounds of one request's adapters

SIZE_PATTERN = r"^(auto|[1-9][0-9]{0,5}x[1-9][0-9]{0,5})$"


def _not_bool(value: Any) -> Any:
    """Numbers are numbers: JSON ``true`` is not 1 (pydantic's lax mode would take it as 1 step or seed 1).
    Strings still parse, since multipart form fields arrive as text (``-F num_inference_steps=4``)."""
    if isinstance(value, bool):
        raise ValueError(f"must be a number, not a boolean (got {str(value).lower()})")
    return value


_BOOL_TEXT = {"true": True, "false": False}


def _strict_bool(value: Any) -> Any:
    """A boolean is ``true``/``false`` (JSON, or the text ``true``/``false`` of a form field); ``"yes"``, ``1``
    and ``"on"`` are errors, not guesses."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, str) and value.strip().lower() in _BOOL_TEXT:
        return _BOOL_TEXT[value.strip().lower()]
    raise ValueError(f"must be a boolean (true or false), got {value!r}")


Int = Annotated[int, BeforeValidator(_not_bool)]
Float = Annotated[float, BeforeValidator(_not_bool)]
Bool = Annotated[bool, BeforeValidator(_strict_bool)]


class LoraRef(BaseModel):
    """One adapter of ``lora``: exactly one of ``name`` (preloaded with ``--lora-modules``) or ``path`` (under a
    ``--lora-dir``), and a ``scale`` multiplying its delta (0 = no adapter; negative subtracts it)."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = Field(default=None, min_length=1, max_length=256)
    path: str | None = Field(default=None, min_length=1, max_length=4096)
    scale: Float = Field(default=1.0, ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_source(self) -> LoraRef:
        if (self.name is None) == (self.path is None):
            raise ValueError("give exactly one of name (a preloaded adapter) or path (under a --lora-dir)")
        return self


def _lora_list(value: Any) -> Any:
    """``lora`` as a list: one object is a list of one; multipart's indexed ``lora[0][name]`` arrives as an object
    keyed by index (kept in index order). More than :data:`MAX_LORAS` adapters is an error on ``lora``."""
    if isinstance(value, dict):
        if value and all(isinstance(k, str) and k.isdigit() for k in value):
            value = [value[k] for k in sorted(value, key=int)]
        else:
            value = [value]
    if isinstance(value, list) and len(value) > MAX_LORAS:
        raise ValueError(f"at most {MAX_LORAS} adapters per request, got {len(value)}")
    return value


LoraList = Annotated[list[LoraRef] | None, BeforeValidator(_lora_list)]


class SharedFields(BaseModel):
    """Fields every generation route takes."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=1_000_000)
    model: str | None = Field(default=None, max_length=512)
    negative_prompt: str | None = Field(default=None, max_length=1_000_000)
    num_inference_steps: Int | None = Field(default=None, ge=1, le=200)
    guidance_scale: Float | None = Field(default=None, ge=0.0, le=20.0, allow_inf_nan=False)
    seed: Int | None = Field(default=None, ge=0, le=MAX_SEED)
    lora: LoraList = None  # LoRA adapters, composed in order (server/lora_http.py)
    model_params: dict[str, Any] | None = None
    extra_params: dict[str, Any] | None = None
    flow_shift: Float | None = Field(default=None, gt=0.0, le=100.0, allow_inf_nan=False)
    timeout_s: Float | None = Field(default=None, gt=0.0, le=30 * 24 * 3600.0, allow_inf_nan=False)
    user: str | None = Field(default=None, max_length=256)


class ImageGenerationRequest(SharedFields):
    """``POST /v1/images/generations``."""

    n: Int = Field(default=1, ge=1, le=10)
    size: str = Field(default="auto", pattern=SIZE_PATTERN)
    response_format: str | None = Field(default="b64_json", max_length=64)
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: Int | None = Field(default=None, ge=0, le=100)
    stream: Bool = False
    partial_images: Int = Field(default=0, ge=0, le=3)
    quality: str | None = Field(default=None, max_length=64)  # draft | standard | high | auto (= standard)
    # OpenAI fields omnicore does not implement: accepted only at their neutral value.
    style: str | None = Field(default=None, max_length=64)
    background: str | None = Field(default=None, max_length=64)
    moderation: str | None = Field(default=None, max_length=64)


class ImageEditFields(ImageGenerationRequest):
    """The non-file fields of ``POST /v1/images/edits``."""

    image_url: list[str] | None = None


class ImageReference(BaseModel):
    """A JSON media reference: a data URL (remote URLs need ``--allow-remote-media``)."""

    model_config = ConfigDict(extra="forbid")
    image_url: str = Field(min_length=1)


class VideoReference(BaseModel):
    """A JSON video reference: a data URL (``data:video/mp4;base64,...``)."""

    model_config = ConfigDict(extra="forbid")
    video_url: str = Field(min_length=1)


class AudioReference(BaseModel):
    """A JSON audio reference: a data URL (``data:audio/wav;base64,...``)."""

    model_config = ConfigDict(extra="forbid")
    audio_url: str = Field(min_length=1)


class VideoCreateRequest(SharedFields):
    """``POST /v1/videos`` and ``/v1/videos/sync``, JSON form (multipart has the same names, with files).

    Conditioning media map to roles: ``input_reference`` -> ``first_frame``, ``last_frame`` -> ``last_frame``,
    ``reference_images``/``reference_video``/``reference_audio`` -> ``reference``; each is gated by the model.
    """

    seconds: int | str | None = None

    @field_validator("seconds", mode="before")
    @classmethod
    def _whole_seconds(cls, value: Any) -> Any:
        """A positive whole number of seconds, ``4`` or ``"4"``; ``true`` and ``1.5`` are errors reported on
        ``seconds`` itself (not coerced to 1, nor blamed on a union member such as ``seconds.int``)."""
        if value is None or type(value) is int or (isinstance(value, str) and value.strip().isdigit()):
            return value
        raise ValueError(f"must be a whole number of seconds (e.g. 4 or \"4\"), got {value!r}")
    num_frames: Int | None = Field(default=None, ge=1, le=100_000)
    size: str | None = Field(default=None, pattern=SIZE_PATTERN)
    fps: Int | None = Field(default=None, ge=1, le=240)
    generate_audio: Bool | None = None
    input_reference: ImageReference | None = None
    last_frame: ImageReference | None = None
    reference_images: list[ImageReference] | None = Field(default=None, max_length=64)
    reference_video: list[VideoReference] | None = Field(default=None, max_length=16)
    reference_audio: list[AudioReference] | None = Field(default=None, max_length=16)
    quality: str | None = Field(default=None, max_length=64)  # draft | standard | high | auto (= standard)


# ---------------------------------------------------------------------------------------------- responses


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None
    seed: int | None = None


class ImagesResponse(BaseModel):
    id: str
    created: int
    model: str
    size: str
    output_format: str
    data: list[ImageData]
    timings: dict[str, float] = {}


class JobError(BaseModel):
    code: str
    message: str


class VideoJob(BaseModel):
    id: str
    object: Literal["video"] = "video"
    model: str
    prompt: str | None = None
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int
    phase: str | None = None
    phase_progress: float | None = None
    step: int | None = None
    total_steps: int | None = None
    queue_position: int | None = None
    eta_s: float | None = None  # estimated seconds until completion, from measured times
    cancel_requested: bool = False
    size: str
    seconds: str
    fps: float | None = None
    num_frames: int | None = None
    seed: int | None = None
    created_at: int
    started_at: int | None = None
    updated_at: int | None = None
    completed_at: int | None = None
    expires_at: int | None = None
    error: JobError | None = None
    media_type: str = "video/mp4"
    timings: dict[str, float] = {}
    usage: dict[str, Any] = {}


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoJob]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


class VideoDeletePending(VideoDeleted):
    """DELETE's 202: the work has not stopped yet (``deleted: false``); the record goes once it does."""

    job: VideoJob


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    omnicore: dict[str, Any]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def inline_schema(model: type[BaseModel]) -> JSON:
    """The model's JSON schema with every ``$ref`` inlined (for hand-written OpenAPI request bodies)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: JSON) -> JSON:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[str(node["$ref"]).rsplit("/", 1)[-1]])  # a JSON-schema $ref is a string
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


VIDEO_MULTIPART_SCHEMA: JSONObject = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {"type": "string", "minLength": 1},
        "model": {"type": "string"},
        "seconds": {"type": "string"},
        "size": {"type": "string"},
        "num_frames": {"type": "integer", "minimum": 1},
        "fps": {"type": "integer", "minimum": 1, "maximum": 240},
        "seed": {"type": "integer", "minimum": 0},
        "num_inference_steps": {"type": "integer", "minimum": 1, "maximum": 200},
        "guidance_scale": {"type": "number", "minimum": 0, "maximum": 20},
        "flow_shift": {"type": "number", "exclusiveMinimum": 0},
        "negative_prompt": {"type": "string"},
        "model_params": {"type": "string", "description": "JSON object of model-specific fields"},
        "input_reference": {"type": "string", "format": "binary"},
        "last_frame": {"type": "string", "format": "binary"},
        "reference_images": {"type": "array", "items": {"type": "string", "format": "binary"}},
        "reference_video": {"type": "array", "items": {"type": "string", "format": "binary"}},
        "reference_audio": {"type": "array", "items": {"type": "string", "format": "binary"}},
        "quality": {"type": "string", "enum": ["auto", "draft", "standard", "high"]},
        "lora": {"type": "string", "description": "JSON array of LoRA adapters, [{\"name\" or \"path\", \"scale\"}]"},
    },
}


def video_body_openapi() -> dict[str, object]:
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": inline_schema(VideoCreateRequest)},
        "multipart/form-data": {"schema": VIDEO_MULTIPART_SCHEMA},
    }}}
