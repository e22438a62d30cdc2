"""Conditioning media of ``POST /v1/videos`` (serving-api.md §8.2): collected from multipart files or JSON data
URLs, gated by the model's declared roles, decoded under caps, and persisted with the job — all before queueing.

Fields and roles: ``input_reference`` (first frame), ``last_frame``, ``reference_images`` (repeatable),
``reference_video`` and ``reference_audio`` (repeatable). Images are recognised by their magic bytes and decoded
with the ``--max-input-image-pixels`` cap; video and audio are probed with PyAV and decoded with the frame-size
cap, a frame-count cap and the duration cap the model's role declares.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import InvalidRequest
from .errors import ApiError
from .media import decode_data_url, decode_image, sniff
from .translate import VIDEO_MEDIA_FIELDS, ServedModel, video_inputs

FILE_FIELDS = tuple(VIDEO_MEDIA_FIELDS)
_SINGLE = ("input_reference", "last_frame")
_URL_KEY = {"image": "image_url", "video": "video_url", "audio": "audio_url"}
_SUFFIX = {"video": "mp4", "audio": "bin"}

#: Frame cap for an uploaded video reference (a model's role may lower the duration further).
MAX_REFERENCE_FRAMES = 1024
#: Duration cap when the model's role declares none.
MAX_REFERENCE_SECONDS = 120.0


def json_fields_from_multipart(fields: dict[str, Any]) -> None:
    """Multipart text values of media fields are data URLs: wrap them as the JSON shapes (in place)."""
    for field, (kind, _) in VIDEO_MEDIA_FIELDS.items():
        value = fields.get(field)
        if value is None:
            continue
        key = _URL_KEY[kind]
        if field in _SINGLE:
            if isinstance(value, str):
                fields[field] = {key: value}
        else:
            items = value if isinstance(value, list) else [value]
            fields[field] = [{key: v} if isinstance(v, str) else v for v in items]


def collect(dto: Any, files: dict[str, list[bytes]]) -> list[tuple[str, bytes]]:
    """``(field, bytes)`` for every conditioning input, files first then data URLs, in field order."""
    raw: list[tuple[str, bytes]] = []
    for field, (kind, _) in VIDEO_MEDIA_FIELDS.items():
        uploaded = files.get(field, [])
        value = getattr(dto, field, None)
        urls = [] if value is None else value if isinstance(value, list) else [value]
        if field in _SINGLE and len(uploaded) + len(urls) > 1:
            what = "given more than once" if not (uploaded and urls) else "given as a file and as a data URL"
            raise ApiError(400, "invalid_value", f"{field} was {what}", param=field)
        raw.extend((field, data) for data in uploaded)
        key = _URL_KEY[kind]
        raw.extend((field, decode_data_url(getattr(u, key), param=field)) for u in urls)
    return raw


def _media_error(exc: InvalidRequest, field: str) -> ApiError:
    return ApiError(400, "invalid_media", f"{field}: {exc.rule}", param=field)


def _duration_caps(served: ServedModel, role: str) -> tuple[float | None, float | None]:
    spec = served.role(role)
    hi = spec.max_duration_s if spec is not None and spec.max_duration_s is not None else MAX_REFERENCE_SECONDS
    return hi, spec.min_duration_s if spec is not None else None


def decode(raw: list[tuple[str, bytes]], served: ServedModel, settings: Any) -> list[tuple[str, Any]]:
    """Gate by role (400 ``unsupported_for_model`` before any decoding), then decode each input (CPU work: call
    from a thread): 415 for an unrecognised format, 400 ``invalid_media`` for broken or over-cap media."""
    from ..media import read_audio_clip, read_video_clip, sniff_kind

    for field, data in raw:  # the format first (magic bytes / container probe): 415 whatever the model
        kind = VIDEO_MEDIA_FIELDS[field][0]
        if kind == "image":
            if sniff(data) is None:
                raise ApiError(415, "unsupported_media_type", f"{field}: not a PNG, JPEG or WebP image", param=field)
            continue
        try:
            found = sniff_kind(data, field=field)
        except InvalidRequest:
            raise ApiError(415, "unsupported_media_type", f"{field}: not a recognised {kind} file",
                           param=field) from None
        if found == "image" or (kind == "video" and found != "video"):
            raise ApiError(415, "unsupported_media_type", f"{field}: expected {kind}, got {found}", param=field)
    video_inputs(served, [(field, None) for field, _ in raw])  # role/kind/count gating, before decoding
    out: list[tuple[str, Any]] = []
    max_px = settings.max_input_image_pixels
    for field, data in raw:
        kind, role = VIDEO_MEDIA_FIELDS[field]
        if kind == "image":
            out.append((field, decode_image(data, param=field, max_pixels=max_px)))
            continue
        hi, lo = _duration_caps(served, role)
        clip: Any
        try:
            if kind == "video":
                clip = read_video_clip(data, field=field, max_frames=MAX_REFERENCE_FRAMES, max_pixels=max_px,
                                       max_duration_s=hi, min_duration_s=lo)
            else:
                clip = read_audio_clip(data, field=field, max_duration_s=hi, min_duration_s=lo)
        except InvalidRequest as exc:
            raise _media_error(exc, field) from None
        out.append((field, clip))
    return out


def persist(folder: Path, raw: list[tuple[str, bytes]]) -> list[dict[str, str]]:
    """Write each input under ``folder``; the job's stored request keeps ``{"field", "path"}`` per input."""
    saved = []
    for i, (field, data) in enumerate(raw):
        kind = VIDEO_MEDIA_FIELDS[field][0]
        suffix = sniff(data) or _SUFFIX.get(kind, "bin")
        path = folder / f"{field}_{i}.{suffix}"
        path.write_bytes(data)
        saved.append({"field": field, "path": str(path)})
    return saved


def load_persisted(inputs: list[Any]) -> list[tuple[str, bytes]]:
    """The stored inputs back as ``(field, bytes)`` (records from before roles hold bare paths: first frames)."""
    raw = []
    for item in inputs:
        field, path = ("input_reference", item) if isinstance(item, str) else (item["field"], item["path"])
        raw.append((field, Path(path).read_bytes()))
    return raw
