"""MiniMax-H3 request rules as pure functions (models.md §1.1–§1.2, seed-contracts §2.3).

Every function takes plain values and returns the normalised value or raises
:class:`omnicore.errors.InvalidRequest` naming the field. :func:`resolve_request` strings them together for the
pipeline's ``preprocess``, which has already decoded the media (it passes a :class:`MediaSummary` per input).
Nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from omnicore.plugin import InvalidRequest

FPS = 24
SAMPLE_RATE = 32000
AUDIO_CHANNELS = 2
AUDIO_LATENTS_PER_SECOND = 40
FRAMES_PER_CHUNK = 17  # video VAE clip length
LATENTS_PER_CHUNK = 5  # latent frames a clip keeps
MIN_DURATION_S = 4.0
MAX_DURATION_S = 15.0
DEFAULT_FRAMES = {"t2va": 209, "fl2va": 209, "ref2va": 124}
#: Denoise steps (DiT calls). The release's default grid has 50 points including the terminal 0, i.e. 49 calls;
#: omnicore counts steps as model calls, so the grid of a request has ``steps + 1`` points.
DEFAULT_STEPS = 49
DEFAULT_VIDEO_SHIFT = 12.0
DEFAULT_AUDIO_SHIFT = 3.0
CANVAS_MULTIPLE = 32
CANVAS_SHORT_EDGE = 768
CANVAS_MAX_PIXELS = 768 * 1344
MIN_ASPECT, MAX_ASPECT = 1 / 4, 4.0
SEQ_ALIGN = 64
MAX_PAD_SEQ_LEN = 1 << 20
MAX_OUTPUTS = 10

ASPECT_RATIOS: dict[str, tuple[int, int]] = {
    "21:9": (21, 9), "16:9": (16, 9), "4:3": (4, 3), "1:1": (1, 1), "3:4": (3, 4), "9:16": (9, 16),
}

#: Reference limits of ref2va (§1.2).
MAX_REFERENCES = {"image": 9, "video": 3, "audio": 3}
MAX_REFERENCES_TOTAL = 12
REF_IMAGE_RATIO = (0.4, 2.5)
REF_IMAGE_SIDES = (256, 5760)
REF_AUDIO_SECONDS = (2.0, 15.0)
#: The video VAE encodes a reference's first 17n+5 frames, so one needs at least 22 (on the 24 fps clock).
MIN_REF_VIDEO_FRAMES = 22

#: Model-specific request fields accepted in ``GenerationRequest.extra`` (anything else is rejected).
EXTRA_FIELDS = ("task", "aspect_ratio", "duration", "duration_seconds", "flow_shift", "audio_flow_shift",
                "frame_indices", "pad_seq_len")

KEYFRAME_ROLES = ("first_frame", "last_frame")


@attrs.frozen
class MediaSummary:
    """What the rules need to know about one decoded input: kind, role, ``size`` (width, height) of an image or a
    video's frames, ``duration_s`` of a video or an audio clip."""

    kind: str
    role: str | None
    size: tuple[int, int] | None = None
    duration_s: float | None = None


@attrs.frozen
class Deployment:
    """What the loaded checkpoint serves: its partitions and its canvas/shift settings (model_index.json)."""

    partitions: tuple[str, ...] = ("fl2va",)  # "fl2va" and/or "ref2va"
    canvas_short_edge: int = CANVAS_SHORT_EDGE
    canvas_max_pixels: int = CANVAS_MAX_PIXELS
    video_shift: float = DEFAULT_VIDEO_SHIFT
    audio_shift: float = DEFAULT_AUDIO_SHIFT
    max_duration_s: float = MAX_DURATION_S

    @property
    def tasks(self) -> tuple[str, ...]:
        out: list[str] = []
        if "fl2va" in self.partitions:
            out += ["t2va", "fl2va"]
        if "ref2va" in self.partitions:
            out.append("ref2va")
        return tuple(out)


@attrs.frozen
class ResolvedRequest:
    """Everything the pipeline needs from one request, normalised."""

    task: str
    prompt: str
    height: int
    width: int
    num_frames: int
    num_latent_frames: int
    num_audio_latents: int
    keyframes: tuple[tuple[int, str], ...] = ()  # (input index, "first" | "last"), packed order
    references: tuple[int, ...] = ()  # input indices, request order
    steps: int = DEFAULT_STEPS
    video_shift: float = DEFAULT_VIDEO_SHIFT
    audio_shift: float = DEFAULT_AUDIO_SHIFT
    pad_seq_len: int | None = None
    num_outputs: int = 1

    @property
    def partition(self) -> str:
        return "ref2va" if self.task == "ref2va" else "fl2va"


# ----------------------------------------------------------------------------------------------- frames


def align_frames(n: int) -> int:
    """Snap up to the next ``17k + 5`` the video VAE decodes: 29 -> 39, 96 -> 107, 209 -> 209."""
    if n < 1:
        raise ValueError(f"frame count must be positive, got {n}")
    return n + (LATENTS_PER_CHUNK - n) % FRAMES_PER_CHUNK


def latent_frames(num_frames: int) -> int:
    """Video latent frames of an aligned count: ``17k + 5 -> 5k + 2`` (2 for 5 frames or fewer)."""
    if num_frames <= LATENTS_PER_CHUNK:
        return 2
    return (num_frames - LATENTS_PER_CHUNK) // FRAMES_PER_CHUNK * LATENTS_PER_CHUNK + 2


def audio_latents(num_frames: int) -> int:
    """Audio latents per channel covering ``num_frames`` video frames (40 per second, rounded)."""
    return round(num_frames / FPS * AUDIO_LATENTS_PER_SECOND)


def _number(value: Any, field: str, what: str = "a positive number") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidRequest(field, f"must be {what}, got {value!r}")
    return float(value)


def pick_duration(params: Any, extra: Mapping[str, Any]) -> tuple[str, float] | None:
    """``(field, seconds)`` of the requested duration, or None. ``params.duration``, ``extra.duration`` and
    ``extra.duration_seconds`` are one setting: giving two different values is ambiguous."""
    found = [(f, v) for f, v in (("params.duration", getattr(params, "duration", None)),
                                 ("extra.duration", extra.get("duration")),
                                 ("extra.duration_seconds", extra.get("duration_seconds"))) if v is not None]
    values = {(_number(v, f, "a positive number of seconds")) for f, v in found}
    if len(values) > 1:
        raise InvalidRequest(found[1][0], f"conflicts with {found[0][0]}; give the duration once")
    return (found[0][0], values.pop()) if found else None


def resolve_frames(task: str, params: Any, extra: Mapping[str, Any], max_duration_s: float,
                   default: int | None = None) -> int:
    """Aligned frame count: duration x 24 (rounded) > ``num_frames`` > ``default`` (None: the task's: 209 for
    t2va/fl2va, 124 for ref2va); the requested length must lie in [4 s, max] (§1.2), then it snaps up to 17n+5
    (so 15 s = 360 frames -> 362)."""
    duration = pick_duration(params, extra)
    num_frames = getattr(params, "num_frames", None)
    if duration is not None:
        field, frames = duration[0], round(duration[1] * FPS)
    elif num_frames is not None and num_frames > 1:
        field, frames = "params.num_frames", int(num_frames)
    else:
        field, frames = "params.num_frames", default or DEFAULT_FRAMES[task]
    if frames / FPS < MIN_DURATION_S:
        raise InvalidRequest(field, f"MiniMax-H3 generates at least {MIN_DURATION_S:g} s ({int(MIN_DURATION_S * FPS)} "
                                    f"frames at {FPS} fps), got {frames} frames")
    if frames / FPS > max_duration_s:  # the serving contract bounds the requested length (diffusers: the aligned)
        raise InvalidRequest(field, f"MiniMax-H3 generates at most {max_duration_s:g} s ({int(max_duration_s * FPS)} "
                                    f"frames at {FPS} fps), got {frames} frames")
    aligned = align_frames(frames)
    return aligned


# ----------------------------------------------------------------------------------------------- canvas


def canvas_for_ratio(aspect_w: float, aspect_h: float, *, short_edge: int = CANVAS_SHORT_EDGE,
                     max_pixels: int = CANVAS_MAX_PIXELS, multiple: int = CANVAS_MULTIPLE,
                     field: str = "extra.aspect_ratio") -> tuple[int, int]:
    """``(height, width)`` of the canvas for a display ratio: short edge ``short_edge``, area capped at
    ``max_pixels``, both axes rounded to ``multiple`` (at least one multiple). 16:9 -> 768x1344."""
    if aspect_w <= 0 or aspect_h <= 0:
        raise InvalidRequest(field, f"aspect ratio must be positive, got {aspect_w}:{aspect_h}")
    ratio = aspect_w / aspect_h
    if not MIN_ASPECT <= ratio <= MAX_ASPECT:
        raise InvalidRequest(field, f"aspect ratio {aspect_w:g}:{aspect_h:g} is outside 1:4 .. 4:1")
    if ratio >= 1.0:
        width, height = short_edge * ratio, float(short_edge)
    else:
        width, height = float(short_edge), short_edge / ratio
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = width * scale, height * scale
    return max(multiple, round(height / multiple) * multiple), max(multiple, round(width / multiple) * multiple)


def parse_aspect_ratio(value: Any, field: str = "extra.aspect_ratio") -> tuple[int, int]:
    if not isinstance(value, str) or value.strip() not in ASPECT_RATIOS:
        raise InvalidRequest(field, f"must be one of {', '.join(ASPECT_RATIOS)}, got {value!r}")
    return ASPECT_RATIOS[value.strip()]


def explicit_size(params: Any, multiple: int = CANVAS_MULTIPLE) -> tuple[int, int] | None:
    """``(height, width)`` from ``params.height``/``params.width`` floored to ``multiple``, or None."""
    h, w = getattr(params, "height", None), getattr(params, "width", None)
    if (h is None) != (w is None):
        raise InvalidRequest("params.height" if h is None else "params.width",
                             "height and width must be given together")
    if h is None or w is None:
        return None
    hf, wf = h // multiple * multiple, w // multiple * multiple
    for value, field in ((hf, "params.height"), (wf, "params.width")):
        if value < multiple:
            given = h if field.endswith("height") else w
            raise InvalidRequest(field, f"must be at least {multiple} pixels, got {given}")
    if not MIN_ASPECT <= wf / hf <= MAX_ASPECT:
        raise InvalidRequest("params.width", f"{wf}x{hf} is outside the 1:4 .. 4:1 aspect range")
    return hf, wf


# ----------------------------------------------------------------------------------------------- task


def resolve_task(extra: Mapping[str, Any], media: Sequence[MediaSummary], deployment: Deployment) -> str:
    """The explicit ``extra.task``, else inferred: references -> ref2va, keyframes -> fl2va, nothing -> t2va
    (a Ref2VA-only deployment infers ref2va)."""
    served = deployment.tasks
    task = extra.get("task")
    if task is not None:
        if task not in ("t2va", "fl2va", "ref2va"):
            raise InvalidRequest("extra.task", f"must be one of t2va, fl2va, ref2va, got {task!r}")
        if task not in served:
            raise InvalidRequest("extra.task", f"this deployment serves {', '.join(served)}; {task} needs the "
                                               f"{'Ref2VA' if task == 'ref2va' else 'FL2VA'} partition")
        return task
    roles = {m.role for m in media}
    if "reference" in roles:
        task = "ref2va"
    elif roles & set(KEYFRAME_ROLES):
        task = "fl2va"
    else:
        task = "ref2va" if served == ("ref2va",) else "t2va"
    if task not in served:
        raise InvalidRequest("inputs", f"the inputs ask for {task}, but this deployment serves {', '.join(served)}")
    return task


def check_media_roles(task: str, media: Sequence[MediaSummary]) -> None:
    allowed = {"t2va": (), "fl2va": KEYFRAME_ROLES, "ref2va": ("reference",)}[task]
    for i, m in enumerate(media):
        if m.role not in allowed:
            rule = ("t2va takes no inputs (use fl2va keyframes or ref2va references)" if task == "t2va" else
                    f"{task} takes only {' / '.join(allowed)} inputs, got role {m.role!r} ({m.kind})")
            raise InvalidRequest(f"inputs[{i}].role", rule)


def resolve_keyframes(media: Sequence[MediaSummary], frame_indices: Any) -> tuple[tuple[int, str], ...]:
    """``(input index, anchor)`` in packed order (first, then last): 1–2 images; ``frame_indices`` (``[0]``,
    ``[-1]`` or ``[0, -1]``), when given, assigns anchors to the images in request order."""
    images = [i for i, m in enumerate(media) if m.kind == "image"]
    for i, m in enumerate(media):
        if m.kind != "image":
            raise InvalidRequest(f"inputs[{i}].kind", f"fl2va keyframes are images, got a {m.kind}")
    if not 1 <= len(images) <= 2:
        raise InvalidRequest("inputs", f"fl2va takes one or two keyframe images, got {len(images)}")
    if frame_indices is not None:
        if (not isinstance(frame_indices, (list, tuple)) or list(frame_indices) not in ([0], [-1], [0, -1])
                or len(frame_indices) != len(images)):
            raise InvalidRequest("extra.frame_indices", f"must be [0] or [-1] for one image, [0, -1] for two, "
                                                        f"got {frame_indices!r}")
        anchors = ["first" if f == 0 else "last" for f in frame_indices]
    else:
        anchors = ["first" if media[i].role == "first_frame" else "last" for i in images]
        if len(set(anchors)) != len(anchors):
            raise InvalidRequest(f"inputs[{images[1]}].role", "two keyframes need one first_frame and one last_frame")
    pairs = sorted(zip(images, anchors), key=lambda p: p[1] != "first")
    return tuple(pairs)


def resolve_references(media: Sequence[MediaSummary], num_frames: int) -> tuple[int, ...]:
    """Validate ref2va references (counts, image geometry, audio lengths); returns their input indices."""
    counts = {"image": 0, "video": 0, "audio": 0}
    audio_total = 0.0
    for i, m in enumerate(media):
        counts[m.kind] += 1
        if counts[m.kind] > MAX_REFERENCES[m.kind]:
            raise InvalidRequest(f"inputs[{i}]", f"ref2va takes at most {MAX_REFERENCES[m.kind]} {m.kind} references")
        if m.kind == "image" and m.size is not None:
            w, h = m.size
            side_lo, side_hi = REF_IMAGE_SIDES
            if not (side_lo <= w <= side_hi and side_lo <= h <= side_hi):
                raise InvalidRequest(f"inputs[{i}].data", f"reference image sides must be in [{side_lo}, {side_hi}] "
                                                          f"pixels, got {w}x{h}")
            if not REF_IMAGE_RATIO[0] <= w / h <= REF_IMAGE_RATIO[1]:
                lo_r, hi_r = REF_IMAGE_RATIO
                raise InvalidRequest(f"inputs[{i}].data", f"reference image aspect (width/height) must be in "
                                                          f"[{lo_r}, {hi_r}], got {w / h:.3f}")
        if m.kind == "video":
            if m.duration_s is not None and m.duration_s * FPS < MIN_REF_VIDEO_FRAMES:
                raise InvalidRequest(f"inputs[{i}].data", f"a reference video needs at least {MIN_REF_VIDEO_FRAMES} "
                                                          f"frames at {FPS} fps ({MIN_REF_VIDEO_FRAMES / FPS:.2f} s), "
                                                          f"got {m.duration_s:.2f} s")
            if m.size is not None and not MIN_ASPECT <= m.size[0] / m.size[1] <= MAX_ASPECT:
                raise InvalidRequest(f"inputs[{i}].data", f"a reference video must be within 1:4 .. 4:1, got "
                                                          f"{m.size[0]}x{m.size[1]}")
        if m.kind == "audio" and m.duration_s is not None:
            lo, hi = REF_AUDIO_SECONDS
            if not lo <= m.duration_s <= hi:
                raise InvalidRequest(f"inputs[{i}].data", f"reference audio must last {lo:g}..{hi:g} s, got "
                                                          f"{m.duration_s:.2f} s")
            audio_total += m.duration_s
    if not media:
        raise InvalidRequest("inputs", "ref2va needs at least one image or video reference")
    if len(media) > MAX_REFERENCES_TOTAL:
        raise InvalidRequest("inputs", f"ref2va takes at most {MAX_REFERENCES_TOTAL} references, got {len(media)}")
    if counts["image"] + counts["video"] == 0:
        raise InvalidRequest("inputs", "an audio reference needs at least one image or video reference with it")
    if audio_total > REF_AUDIO_SECONDS[1]:
        raise InvalidRequest("inputs", f"reference audio may total at most {REF_AUDIO_SECONDS[1]:g} s, got "
                                       f"{audio_total:.2f} s")
    return tuple(range(len(media)))


# ----------------------------------------------------------------------------------------------- others


def check_extra(extra: Mapping[str, Any]) -> None:
    unknown = sorted(set(extra) - set(EXTRA_FIELDS))
    if unknown:
        raise InvalidRequest(f"extra.{unknown[0]}", f"unknown MiniMax-H3 field; accepted: {', '.join(EXTRA_FIELDS)}")


def check_unsupported(params: Any, negative_prompt: Any) -> None:
    """The checkpoint is guidance-distilled and runs at a fixed 24 fps."""
    if negative_prompt is not None:
        raise InvalidRequest("negative_prompt", "MiniMax-H3 is guidance-distilled and takes no negative prompt")
    g = getattr(params, "guidance_scale", None)
    if g is not None and g != 1.0:
        raise InvalidRequest("params.guidance_scale", f"MiniMax-H3 is guidance-distilled (one forward per step); "
                                                      f"leave guidance unset, got {g}")
    fps = getattr(params, "fps", None)
    if fps is not None and fps != FPS:
        raise InvalidRequest("params.fps", f"MiniMax-H3 generates at a fixed {FPS} fps, got {fps:g}")
    n = getattr(params, "num_outputs", 1)
    if not 1 <= n <= MAX_OUTPUTS:
        raise InvalidRequest("params.num_outputs", f"must be between 1 and {MAX_OUTPUTS}, got {n}")


def resolve_steps(params: Any, default: int = DEFAULT_STEPS) -> int:
    steps = getattr(params, "num_inference_steps", None)
    steps = default if steps is None else steps
    if steps < 1:
        raise InvalidRequest("params.num_inference_steps", f"must be at least 1, got {steps}")
    return int(steps)


def resolve_shift(value: Any, field: str, default: float) -> float:
    return default if value is None else _number(value, field, "a positive shift")


def resolve_pad_seq_len(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % SEQ_ALIGN or \
            value > MAX_PAD_SEQ_LEN:
        raise InvalidRequest("extra.pad_seq_len", f"must be a positive multiple of {SEQ_ALIGN} up to "
                                                  f"{MAX_PAD_SEQ_LEN}, got {value!r}")
    return value


def resolve_canvas(task: str, params: Any, extra: Mapping[str, Any], media: Sequence[MediaSummary],
                   keyframes: Sequence[tuple[int, str]], deployment: Deployment) -> tuple[int, int]:
    """t2va: ``extra.aspect_ratio`` is required (explicit height/width then win); fl2va: the ratio of the first
    keyframe in packed order unless one is given; ref2va: 16:9 by default."""
    ratio_value = extra.get("aspect_ratio")
    ratio = parse_aspect_ratio(ratio_value) if ratio_value is not None else None
    if task == "t2va" and ratio is None:
        raise InvalidRequest("extra.aspect_ratio", f"t2va requires an explicit aspect_ratio (one of "
                                                   f"{', '.join(ASPECT_RATIOS)})")
    size = explicit_size(params)
    if size is not None:
        return size
    if ratio is None and task == "fl2va":
        ratio = media[keyframes[0][0]].size or (16, 9)
    if ratio is None:
        ratio = ASPECT_RATIOS["16:9"]
    field = "extra.aspect_ratio" if ratio_value is not None else f"inputs[{keyframes[0][0]}].data" if keyframes \
        else "extra.aspect_ratio"
    return canvas_for_ratio(*ratio, short_edge=deployment.canvas_short_edge, max_pixels=deployment.canvas_max_pixels,
                            field=field)


def resolve_request(*, prompt: Any, negative_prompt: Any, params: Any, extra: Mapping[str, Any],
                    media: Sequence[MediaSummary], deployment: Deployment, default_steps: int = DEFAULT_STEPS,
                    default_frames: int | None = None) -> ResolvedRequest:
    """Apply every rule to one request (``params`` is an omnicore ``SamplingParams``). ``default_steps`` /
    ``default_frames`` come from the served spec (a tiny preset's are smaller)."""
    check_extra(extra)
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidRequest("prompt", "MiniMax-H3 takes a non-empty text prompt")
    check_unsupported(params, negative_prompt)
    task = resolve_task(extra, media, deployment)
    check_media_roles(task, media)
    num_frames = resolve_frames(task, params, extra, deployment.max_duration_s, default_frames)
    keyframes: tuple[tuple[int, str], ...] = ()
    references: tuple[int, ...] = ()
    if task == "fl2va":
        keyframes = resolve_keyframes(media, extra.get("frame_indices"))
    elif extra.get("frame_indices") is not None:
        raise InvalidRequest("extra.frame_indices", "only fl2va keyframes take frame_indices")
    if task == "ref2va":
        references = resolve_references(media, num_frames)
    height, width = resolve_canvas(task, params, extra, media, keyframes, deployment)
    return ResolvedRequest(
        task=task, prompt=prompt, height=height, width=width, num_frames=num_frames,
        num_latent_frames=latent_frames(num_frames), num_audio_latents=audio_latents(num_frames),
        keyframes=keyframes, references=references, steps=resolve_steps(params, default_steps),
        video_shift=resolve_shift(extra.get("flow_shift", getattr(params, "flow_shift", None)),
                                  "extra.flow_shift" if "flow_shift" in extra else "params.flow_shift",
                                  deployment.video_shift),
        audio_shift=resolve_shift(extra.get("audio_flow_shift"), "extra.audio_flow_shift", deployment.audio_shift),
        pad_seq_len=resolve_pad_seq_len(extra.get("pad_seq_len")),
        num_outputs=int(getattr(params, "num_outputs", 1)),
    )
