"""Conditioning media of ``POST /v1/videos``: collected from multipart files or JSON data
URLs, gated by the model's declared roles, decoded under caps, and persisted with the job — all before queueing.

Fields and roles: ``input_reference`` (first frame), ``last_frame``, ``reference_images`` (repeatable),
``reference_video`` and ``reference_audio`` (repeatable). Images are recognised by their magic bytes and decoded
with the ``--max-input-image-pixels`` cap; video and audio are probed with PyAV and decoded with the frame-size
cap, a frame-count cap and the duration cap the model's role declares.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidRequest
from ..media import MAX_AUDIO_CHANNELS
from .errors import ApiError
from .media import budget_for, decode_data_url, decode_image, sniff
from .translate import VIDEO_MEDIA_FIELDS, ServedModel, video_inputs

if TYPE_CHECKING:
    from .schemas import VideoCreateRequest
    from .settings import ServerSettings

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


def collect(dto: VideoCreateRequest, files: dict[str, list[bytes]]) -> list[tuple[str, bytes]]:
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
    code = "image_too_large" if exc.code == "image_too_large" else "invalid_media"
    return ApiError(400, code, f"{field}: {exc.rule}", param=field)


def _duration_caps(served: ServedModel, role: str) -> tuple[float | None, float | None]:
    spec = served.role(role)
    hi = spec.max_duration_s if spec is not None and spec.max_duration_s is not None else MAX_REFERENCE_SECONDS
    return hi, spec.min_duration_s if spec is not None else None


def _video_scale(served: ServedModel) -> tuple[int | None, float | None]:
    """The largest frame (pixels) and the longest stretch (seconds) of a reference the model can use, from its
    declared output limits (``max_pixels``; ``max_frames`` at the slowest fps); ``None`` where it declares none."""
    caps = served.spec.capabilities if served.spec is not None else None
    if caps is None:
        return None, None
    seconds = None
    if caps.max_frames and caps.fps_range:
        seconds = caps.max_frames / max(1e-6, caps.fps_range[0])
    return caps.max_pixels, seconds


def decode(raw: list[tuple[str, bytes]], served: ServedModel, settings: ServerSettings, *,
           admitted: bool = False) -> list[tuple[str, object]]:
    """Gate by role (400 ``unsupported_for_model`` before any decoding), check every input's header, reserve its
    decoded size in the server's ``--max-decode-bytes`` budget (400/429), then decode (CPU work: call from a
    thread): 415 for an unrecognised format, 400 ``invalid_media`` / ``image_too_large`` for broken or over-cap
    media.

    Nothing is decoded before every input passed its header checks. Images and audio are decoded here (audio
    downmixed to mono/stereo); a video becomes a clip whose frames are decoded only when the model reads them
    (:class:`omnicore.media.LazyFrames`), at the model's declared size and length, so the model's own rules
    (deployment, per-kind counts) run first and a queued job holds only the compressed upload.

    ``admitted``: the inputs of a job accepted earlier (re-enqueued after a restart): their share is counted but
    the budget never refuses them (an accepted job is not dropped).
    """
    import math

    from ..media import lazy_video_clip, open_image, probe_media, read_audio_clip, sniff_kind

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
    max_px = settings.max_input_image_pixels
    scale_px, use_s = _video_scale(served)
    planned: list[tuple[str, object, int]] = []  # (field, lazy clip or None, estimated decoded bytes)
    for field, data in raw:  # every header, before anything is decoded
        kind, role = VIDEO_MEDIA_FIELDS[field]
        hi, lo = _duration_caps(served, role)
        try:
            if kind == "image":
                with open_image(data, field=field, max_pixels=max_px) as img:
                    w, h = img.size
                planned.append((field, None, w * h * 3))
            elif kind == "video":
                probe = probe_media("video", data, field=field)
                keep = math.ceil(use_s * probe.fps) + 1 if use_s is not None and probe.fps > 0 else None
                clip = lazy_video_clip(data, field=field, max_frames=MAX_REFERENCE_FRAMES, max_pixels=max_px,
                                       max_duration_s=hi, min_duration_s=lo,
                                       keep_frames=keep, scale_to_pixels=scale_px)
                f, fh, fw, _ = clip.frames.shape
                planned.append((field, clip, f * fh * fw * 3))
            else:
                probe = probe_media("audio", data, field=field)
                if probe.channels > MAX_AUDIO_CHANNELS:
                    raise InvalidRequest(field, f"has {probe.channels} audio channels, more than the "
                                                f"{MAX_AUDIO_CHANNELS} accepted (it is downmixed to stereo)")
                planned.append((field, None, probe.decoded_bytes()))
        except InvalidRequest as exc:
            raise _media_error(exc, field) from None
    budget = budget_for(settings)
    total = sum(n for _, _, n in planned)
    reserved = (budget.force(total) if admitted else budget.reserve(total, param=raw[0][0])) if raw else 0
    out: list[tuple[str, object]] = []
    try:
        for (field, data), (_, lazy, _) in zip(raw, planned):
            kind, role = VIDEO_MEDIA_FIELDS[field]
            if kind == "image":
                out.append((field, decode_image(data, param=field, max_pixels=max_px)))
            elif kind == "video":
                out.append((field, lazy))
            else:
                hi, lo = _duration_caps(served, role)
                try:
                    out.append((field, read_audio_clip(data, field=field, max_duration_s=hi, min_duration_s=lo)))
                except InvalidRequest as exc:
                    raise _media_error(exc, field) from None
    except BaseException:
        budget.release(reserved)
        raise
    budget.hold([v for _, v in out], reserved)
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
