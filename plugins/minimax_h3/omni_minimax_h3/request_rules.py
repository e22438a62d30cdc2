"""MiniMax-H3 request rules as pure functions.

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

#: Reference limits of ref2va.
MAX_REFERENCES = {"image": 9, "video": 3, "audio": 3}
MAX_REFERENCES_TOTAL = 12
REF_IMAGE_RATIO = (0.4, 2.5)
REF_IMAGE_SIDES = (256, 5760)
REF_AUDIO_SECONDS = (2.0, 15.0)
#: The video VAE encodes a reference's first 17n+5 frames, so one needs at least 22 (on the 24 fps clock).
MIN_REF_VIDEO_FRAMES = 22

#: Model-specific request fields accepted in ``GenerationRequest.extra``: ``ModelSpec.extra_fields``, so the core
#: refuses any other key before these rules run (omnicore's ``check_extra``).
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
    #: what height and width are multiples of: the VAE's spatial ratio x the DiT's patch (32 for the release)
    canvas_multiple: int = CANVAS_MULTIPLE
    #: per-partition ``(video, audio)`` shift defaults where a partition's own metadata says so (the official
    #: layout has one ``model_index.json`` per partition); others use ``video_shift`` / ``audio_shift``
    partition_shifts: Mapping[str, tuple[float, float]] = attrs.field(factory=dict)

    def shifts(self, partition: str) -> tuple[float, float]:
        """The ``(video, audio)`` shift defaults of the DiT serving ``partition``."""
        pair = self.partition_shifts.get(partition)
        return (float(pair[0]), float(pair[1])) if pair is not None else (self.video_shift, self.audio_shift)

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


def frame_limits(max_duration_s: float = MAX_DURATION_S) -> tuple[int, int]:
    """``(min, max)`` requested frames: at least 4 s (96 frames at 24 fps); at most the ``17n + 5`` count that
    ``max_duration_s`` snaps up to (15 s = 360 frames -> 362), since that is what such a request generates."""
    return int(MIN_DURATION_S * FPS), align_frames(int(round(max_duration_s * FPS)))


def resolve_frames(task: str, params: Any, extra: Mapping[str, Any], max_duration_s: float,
                   default: int | None = None) -> int:
    """Aligned frame count: duration x 24 (rounded) > ``num_frames`` > ``default`` (None: the task's: 209 for
    t2va/fl2va, 124 for ref2va); it snaps up to 17n+5 and must lie within :func:`frame_limits` (a 15 s request
    is 360 frames and generates 362; 363 frames would generate 379 and are refused)."""
    duration = pick_duration(params, extra)
    num_frames = getattr(params, "num_frames", None)
    if duration is not None:
        field, frames = duration[0], round(duration[1] * FPS)
        asked = f"{duration[1]:g} s = {frames} frames"
    elif num_frames is not None and num_frames > 1:
        field, frames = "params.num_frames", int(num_frames)
        asked = f"{frames} frames"
    else:
        field, frames = "params.num_frames", default or DEFAULT_FRAMES[task]
        asked = f"{frames} frames"
    lo, hi = frame_limits(max_duration_s)
    if frames < lo:
        raise InvalidRequest(field, f"MiniMax-H3 generates at least {MIN_DURATION_S:g} s ({lo} frames at {FPS} "
                                    f"fps), got {asked}")
    aligned = align_frames(frames)
    if aligned > hi:  # the serving contract allows the 4 s diffusers refuses; the cap is on what is generated
        raise InvalidRequest(field, f"MiniMax-H3 generates at most {hi} frames ({max_duration_s:g} s at {FPS} fps, "
                                    f"snapped up to the 17n+5 frame grid), got {asked} (-> {aligned})")
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


def nearest_sizes(height: int, width: int, multiple: int = CANVAS_MULTIPLE) -> list[tuple[int, int]]:
    """The on-grid ``(height, width)`` sizes around an off-grid one (each axis floored or ceiled to
    ``multiple``, at least one multiple, within 1:4 .. 4:1), the one keeping the aspect ratio best first."""
    def around(v: int) -> set[int]:
        low = v // multiple * multiple
        return {max(multiple, low), low + multiple} if v % multiple else {v}

    ratio = width / height
    sizes = [(h, w) for h in around(height) for w in around(width) if MIN_ASPECT <= w / h <= MAX_ASPECT]
    return sorted(sizes, key=lambda hw: (abs(math.log(hw[1] / hw[0] / ratio)), abs(hw[0] * hw[1] - height * width)))


def explicit_size(params: Any, multiple: int = CANVAS_MULTIPLE) -> tuple[int, int] | None:
    """``(height, width)`` from ``params.height``/``params.width``, or None. Both must be on the model's grid
    (multiples of ``multiple``): an off-grid size is refused naming the nearest valid sizes — never floored
    silently (flooring 100x50 to 96x32 would turn 2:1 into 3:1)."""
    h, w = getattr(params, "height", None), getattr(params, "width", None)
    if (h is None) != (w is None):
        raise InvalidRequest("params.height" if h is None else "params.width",
                             "height and width must be given together")
    if h is None or w is None:
        return None
    for value, field in ((h, "params.height"), (w, "params.width")):
        if isinstance(value, bool) or not isinstance(value, int) or value < multiple:
            raise InvalidRequest(field, f"must be at least {multiple} pixels, got {value!r}")
    if h % multiple or w % multiple:
        near = ", ".join(f"{nw}x{nh}" for nh, nw in nearest_sizes(h, w, multiple))
        raise InvalidRequest("params.width" if w % multiple else "params.height",
                             f"size {w}x{h} (width x height) is not on MiniMax-H3's grid: both sides must be "
                             f"multiples of {multiple}; nearest valid sizes: {near}")
    if not MIN_ASPECT <= w / h <= MAX_ASPECT:
        raise InvalidRequest("params.width", f"{w}x{h} is outside the 1:4 .. 4:1 aspect range")
    return h, w


def _ratio_fits(name: str, height: int, width: int, deployment: Deployment) -> bool:
    """Whether ``height x width`` is what ratio ``name`` comes to on this deployment: its canvas, or the ratio
    itself with the long side rounded to the grid (e.g. 448x256 is 16:9, 288x512 is 9:16)."""
    aw, ah = ASPECT_RATIOS[name]
    m = deployment.canvas_multiple
    if canvas_for_ratio(aw, ah, short_edge=deployment.canvas_short_edge, max_pixels=deployment.canvas_max_pixels,
                        multiple=m) == (height, width):
        return True
    if aw >= ah:
        return width == max(m, round(height * aw / ah / m) * m)
    return height == max(m, round(width * ah / aw / m) * m)


def nearest_ratio(height: int, width: int) -> str:
    """The supported aspect ratio closest to ``width / height`` (in log space)."""
    return min(ASPECT_RATIOS, key=lambda n: abs(math.log(width / height * ASPECT_RATIOS[n][1] /
                                                         ASPECT_RATIOS[n][0])))


def ratio_of_size(height: int, width: int, deployment: Deployment) -> str | None:
    """The supported ratio an explicit size matches (see :func:`_ratio_fits`), the closest when several do, or
    None when it matches none."""
    name = nearest_ratio(height, width)
    if _ratio_fits(name, height, width, deployment):
        return name
    fits = [n for n in ASPECT_RATIOS if _ratio_fits(n, height, width, deployment)]
    return fits[0] if fits else None


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
    """The ``(height, width)`` to generate.

    - Explicit ``params.height``/``params.width`` win (on the grid, see :func:`explicit_size`). An
      ``extra.aspect_ratio`` given with them must agree (the ratio the size matches, or the nearest supported
      one): a contradiction (``9:16`` with 256x256) is refused naming both fields rather than ignored.
    - t2va needs a ratio: ``extra.aspect_ratio``, or one derived from an explicit size that matches a supported
      ratio (the reference requires it even then; here 448x256 simply is 16:9).
    - Otherwise fl2va takes the ratio of the first keyframe in packed order, ref2va 16:9.
    """
    ratio_value = extra.get("aspect_ratio")
    ratio = parse_aspect_ratio(ratio_value) if ratio_value is not None else None
    size = explicit_size(params, deployment.canvas_multiple)
    if size is not None:
        h, w = size
        if ratio_value is not None:
            name = ratio_value.strip()
            if not (_ratio_fits(name, h, w, deployment) or name == nearest_ratio(h, w)):
                matched = ratio_of_size(h, w, deployment)
                what = f"matches {matched}" if matched else f"is nearest {nearest_ratio(h, w)}"
                raise InvalidRequest("extra.aspect_ratio", f"{name} contradicts params.width x params.height = "
                                                           f"{w}x{h}, which {what}; give one of them, or make them "
                                                           f"agree")
        elif task == "t2va" and ratio_of_size(h, w, deployment) is None:
            raise InvalidRequest("extra.aspect_ratio", f"t2va requires an explicit aspect_ratio (one of "
                                                       f"{', '.join(ASPECT_RATIOS)}): the size {w}x{h} matches "
                                                       f"none of them (nearest: {nearest_ratio(h, w)})")
        return size
    if task == "t2va" and ratio is None:
        raise InvalidRequest("extra.aspect_ratio", f"t2va requires an explicit aspect_ratio (one of "
                                                   f"{', '.join(ASPECT_RATIOS)}), or a height and width that "
                                                   f"match one")
    if ratio is None and task == "fl2va":
        ratio = media[keyframes[0][0]].size or (16, 9)
    if ratio is None:
        ratio = ASPECT_RATIOS["16:9"]
    field = "extra.aspect_ratio" if ratio_value is not None else f"inputs[{keyframes[0][0]}].data" if keyframes \
        else "extra.aspect_ratio"
    return canvas_for_ratio(*ratio, short_edge=deployment.canvas_short_edge, max_pixels=deployment.canvas_max_pixels,
                            multiple=deployment.canvas_multiple, field=field)


def resolve_request(*, prompt: Any, negative_prompt: Any, params: Any, extra: Mapping[str, Any],
                    media: Sequence[MediaSummary], deployment: Deployment, default_steps: int = DEFAULT_STEPS,
                    default_frames: int | None = None) -> ResolvedRequest:
    """Apply every rule to one request (``params`` is an omnicore ``SamplingParams``). ``default_steps`` /
    ``default_frames`` come from the served spec (a tiny preset's are smaller)."""
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
    video_shift, audio_shift = deployment.shifts("ref2va" if task == "ref2va" else "fl2va")
    return ResolvedRequest(
        task=task, prompt=prompt, height=height, width=width, num_frames=num_frames,
        num_latent_frames=latent_frames(num_frames), num_audio_latents=audio_latents(num_frames),
        keyframes=keyframes, references=references, steps=resolve_steps(params, default_steps),
        video_shift=resolve_shift(extra.get("flow_shift", getattr(params, "flow_shift", None)),
                                  "extra.flow_shift" if "flow_shift" in extra else "params.flow_shift",
                                  video_shift),
        audio_shift=resolve_shift(extra.get("audio_flow_shift"), "extra.audio_flow_shift", audio_shift),
        pad_seq_len=resolve_pad_seq_len(extra.get("pad_seq_len")),
        num_outputs=int(getattr(params, "num_outputs", 1)),
    )
