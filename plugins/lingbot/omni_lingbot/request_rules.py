"""LingBot request rules as pure functions.

Every function takes plain values and either returns the normalised value or raises
:class:`omnicore.errors.InvalidRequest` naming the field. :func:`resolve_request` strings them together for the
pipeline's ``preprocess``; nothing here imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from omnicore.plugin import InvalidRequest, parse_size_wh

from .prompts import compact_json, default_negative_prompt
from .stage_options import (
    MAX_SCHEDULE_STEPS,
    REFINER_FIELDS,
    TILING_FIELDS,
    RefinerOptions,
    VaeTiling,
    extra_bool,
    resolve_refiner,
    resolve_vae_tiling,
)

DEFAULT_NUM_FRAMES = 81
DEFAULT_FPS = 24.0
DEFAULT_HEIGHT = 480
DEFAULT_WIDTH = 480
DEFAULT_SHIFT = 3.0
DEFAULT_SIGMA_TAIL_STEPS = 2
SIZE_MULTIPLE = 16

#: Prompt-mapping keys that steer the run rather than describe the scene; they never reach the caption.
RUNTIME_PROMPT_KEYS = ("duration", "seconds", "fps", "height", "width", "size", "num_frames", "resolution", "ratio")

#: Model-specific request fields accepted in ``GenerationRequest.extra``: ``ModelSpec.extra_fields``, so the core
#: refuses any other key before these rules run (omnicore's ``check_extra``).
EXTRA_FIELDS = (
    "batch_cfg", "null_cond_clone_zero", "negative_prompt", "size", "resolution", "aspect_ratio", "ratio", "seconds",
    "duration",
    "shift", "flow_shift", "t_thresh", "base_low_noise_threshold", "base_sigma_tail_steps",
    "offload_vae_during_denoise", *REFINER_FIELDS, *TILING_FIELDS,
)

#: Resolution presets as (height, width), keyed by resolution then ratio label (read as the upstream runner
#: stores them; docs/contracts-status.md C8.5 keeps the orientation an open point).
RESOLUTION_PRESETS: dict[str, dict[str, tuple[int, int]]] = {
    "192p": {"1:1": (192, 192), "9:16": (192, 320), "16:9": (320, 192), "3:4": (192, 256), "4:3": (256, 192)},
    "480p": {"1:1": (480, 480), "9:16": (480, 832), "16:9": (832, 480), "3:4": (480, 640), "4:3": (640, 480)},
    "720p": {"1:1": (736, 736), "9:16": (736, 1280), "16:9": (1280, 736), "3:4": (736, 960), "4:3": (960, 736)},
    "1080p": {"1:1": (1088, 1088), "9:16": (1088, 1920), "16:9": (1920, 1088), "3:4": (1088, 1440),
              "4:3": (1440, 1088)},
    "2k": {"1:1": (1440, 1440), "9:16": (1440, 2560), "16:9": (2560, 1440), "3:4": (1440, 1920),
           "4:3": (1920, 1440)},
    "4k": {"1:1": (2176, 2176), "9:16": (2176, 3840), "16:9": (3840, 2176), "3:4": (2176, 2880),
           "4:3": (2880, 2176)},
}


# ----------------------------------------------------------------------------------------------- mode


def resolve_mode(
    modalities: Sequence[str] | None,
    num_images: int,
    *,
    num_videos: int = 0,
    num_audios: int = 0,
    output_type: str = "auto",
) -> str:
    """``"t2i"``, ``"t2v"`` or ``"ti2v"`` from the requested output modality and the reference count.

    Without ``modalities`` an explicit ``output_type`` ("image"/"video") stands in for it; with neither the
    request is legacy text-to-video and must not carry an image (the caller has to say what it wants).
    """
    if num_videos or num_audios:
        raise InvalidRequest("references", "video and audio reference modalities are not supported by LingBot; "
                                           "pass at most one image")
    if modalities is None and output_type in ("image", "video"):
        modalities = (output_type,)
    if modalities is None:
        if num_images:
            raise InvalidRequest("modalities", "an input image requires modalities to be explicitly set "
                                               "(['video'] for image-to-video)")
        return "t2v"
    mods = tuple(modalities)
    if len(mods) != 1 or mods[0] not in ("image", "video"):
        raise InvalidRequest("modalities", f"unsupported output modality {list(mods)}; LingBot produces exactly "
                                           "one of 'image' or 'video'")
    if mods[0] == "image":
        if num_images:
            raise InvalidRequest("images", "text-to-image does not accept input images")
        return "t2i"
    if num_images == 0:
        return "t2v"
    if num_images == 1:
        return "ti2v"
    raise InvalidRequest("images", f"image-to-video takes exactly one input image, got {num_images}")


# ----------------------------------------------------------------------------------------------- caption


def resolve_caption(prompt: str | Mapping[str, Any]) -> str:
    """The text the encoder sees: a string as is; a mapping's ``caption`` (JSON-serialised when structured),
    else the compact JSON of its descriptive keys (runtime keys such as ``duration`` removed, order kept)."""
    if isinstance(prompt, str):
        caption = prompt
    elif isinstance(prompt, Mapping):
        if "caption" in prompt:
            value = prompt["caption"]
            if isinstance(value, str):
                caption = value
            elif isinstance(value, Mapping):
                caption = compact_json(dict(value)) if value else ""
            else:
                raise InvalidRequest("prompt.caption", f"must be a string or a mapping, got {type(value).__name__}")
        else:
            rest = {k: v for k, v in prompt.items() if k not in RUNTIME_PROMPT_KEYS}
            caption = compact_json(rest) if rest else ""
    else:
        raise InvalidRequest("prompt", f"must be a string or a mapping, got {type(prompt).__name__}")
    if not caption.strip():
        raise InvalidRequest("prompt", "the caption must not be empty")
    return caption


# ----------------------------------------------------------------------------------------------- frames


def round_up_frames(n: int) -> int:
    """The causal VAE needs ``4k + 1`` frames; round up: 1→1, 2→5, 96→97, 98→101."""
    return math.ceil((n - 1) / 4) * 4 + 1


def check_num_frames(value: Any, field: str = "num_frames") -> int:
    """A positive integer (an integral float such as ``5.0`` from JSON is accepted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(field, f"num_frames must be a positive integer, got {value!r}")
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise InvalidRequest(field, f"num_frames must be a positive integer, got {value!r}")
    if value < 1:
        raise InvalidRequest(field, f"num_frames must be a positive integer, got {value!r}")
    return int(value)


def _positive_number(value: Any, field: str, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidRequest(field, f"{what} must be a positive number, got {value!r}")
    return float(value)


def check_fps(value: Any, field: str = "fps") -> int:
    """The frame rate, a positive whole number (the reference takes an int fps and rejects others; an integral
    float such as ``24.0`` from JSON is accepted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidRequest(field, f"fps must be a positive whole number, got {value!r}")
    if isinstance(value, float) and not value.is_integer():
        raise InvalidRequest(field, f"fps must be a whole number of frames per second (LingBot takes an integer "
                                    f"fps), got {value!r}")
    return int(value)


def frames_from_duration(duration: Any, fps: Any, *, field: str = "duration") -> int:
    """The reference's conversion: ``n = int(duration × fps)`` (truncated, float arithmetic); fewer than one frame
    is an error; then :func:`round_up_frames` puts ``n`` on the causal VAE's ``4k + 1`` grid (rounding up, so a
    count already on the grid stays): (4 s, 24 fps) → 96 → 97, (1 s, 25 fps) → 25 → 25, (0.25 s, 20 fps) → 5 →
    5, (0.01 s, 24 fps) → 0 → rejected."""
    d = _positive_number(duration, field, "duration")
    rate = check_fps(fps)
    n = int(d * rate)
    if n < 1:
        raise InvalidRequest(field, f"duration {duration!r} s at {rate} fps must produce at least one frame "
                                    f"(int(duration x fps) = {n})")
    return round_up_frames(n)


def pick_ratio(values: Mapping[str, Any], source: str) -> Any:
    """The request's aspect-ratio label: ``extra.aspect_ratio`` (the name every omnicore model takes) or
    ``extra.ratio`` (the reference runner's, which its prompt mappings keep using); both at once is rejected."""
    given = [k for k in ("aspect_ratio", "ratio") if values.get(k) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"{source}ratio", "give either aspect_ratio or ratio, not both")
    return values[given[0]] if given else None


def pick_duration(
    prompt: Mapping[str, Any], extra: Mapping[str, Any], params_duration: Any = None
) -> tuple[str, Any] | None:
    """``(field, value)`` of the duration to use, or ``None``: the prompt mapping's beats the request's.

    ``seconds`` (the video API's name, which the server stores as ``params.duration``) and ``duration`` are the
    same thing, so one level naming it twice — ``extra.seconds`` with ``extra.duration`` or ``params.duration``,
    or both keys in the prompt mapping — is ambiguous and rejected.
    """
    prompt_level = [(f"prompt.{k}", prompt[k]) for k in ("duration", "seconds") if prompt.get(k) is not None]
    request_level = [(f"extra.{k}", extra[k]) for k in ("duration", "seconds") if extra.get(k) is not None]
    if params_duration is not None:
        request_level.append(("params.duration", params_duration))
    for found in (prompt_level, request_level):
        if len(found) > 1:
            raise InvalidRequest(found[1][0], f"give either seconds or duration, not both "
                                              f"({' and '.join(field for field, _ in found)})")
        if found:
            return found[0]
    return None


def resolve_num_frames(
    mode: str,
    explicit: tuple[str, Any] | None,
    duration: tuple[str, Any] | None,
    fps: float,
    default: int = DEFAULT_NUM_FRAMES,
) -> int:
    """Priority: explicit ``num_frames`` > duration × fps > ``default`` (81, or the preset's); text-to-image is
    exactly one frame."""
    if mode == "t2i":
        if duration is not None:
            raise InvalidRequest(duration[0], "text-to-image does not accept a duration")
        if explicit is not None and check_num_frames(explicit[1], explicit[0]) != 1:
            raise InvalidRequest(explicit[0], f"text-to-image requires exactly one frame, got {explicit[1]}")
        return 1
    if explicit is not None:
        return round_up_frames(check_num_frames(explicit[1], explicit[0]))
    if duration is not None:
        return frames_from_duration(duration[1], fps, field=duration[0])
    return round_up_frames(default)


# ----------------------------------------------------------------------------------------------- size


def _check_dim(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise InvalidRequest(field, f"{field.rsplit('.', 1)[-1]} must be a positive integer, got {value!r}")
    return value


def resolve_size(
    *,
    width: Any = None,
    height: Any = None,
    size: Any = None,
    resolution: Any = None,
    ratio: Any = None,
    source: str = "",
) -> tuple[int, int] | None:
    """``(height, width)`` from exactly one of width+height, ``size "WxH"`` or resolution+ratio; ``None`` if
    none is given. Dimensions must be multiples of 16. ``source`` prefixes field names in errors."""
    if (width is None) != (height is None):
        raise InvalidRequest(f"{source}{'height' if height is None else 'width'}",
                             "width and height must be provided together")
    if (resolution is None) != (ratio is None):
        raise InvalidRequest(f"{source}{'ratio' if ratio is None else 'resolution'}",
                             "resolution and ratio must be provided together")
    forms = [name for name, present in (("width/height", width is not None), ("size", size is not None),
                                        ("resolution/ratio", resolution is not None)) if present]
    if len(forms) > 1:
        raise InvalidRequest(f"{source}{forms[1].split('/')[0]}",
                             f"{' and '.join(forms)} are mutually exclusive; give exactly one")
    if not forms:
        return None
    if resolution is not None:
        table = RESOLUTION_PRESETS.get(str(resolution).lower())
        if table is None:
            raise InvalidRequest(f"{source}resolution",
                                 f"unknown resolution {resolution!r}; known: {', '.join(RESOLUTION_PRESETS)}")
        if ratio not in table:
            raise InvalidRequest(f"{source}ratio", f"unknown ratio {ratio!r}; known: {', '.join(table)}")
        return table[ratio]
    if size is not None:
        w, h = parse_size_wh(size, f"{source}size")
        fields = (f"{source}size", f"{source}size")
    else:
        h, w = _check_dim(height, f"{source}height"), _check_dim(width, f"{source}width")
        fields = (f"{source}height", f"{source}width")
    for dim, name, field in ((h, "height", fields[0]), (w, "width", fields[1])):
        if dim <= 0:
            raise InvalidRequest(field, f"{name} must be a positive integer, got {dim}")
        if dim % SIZE_MULTIPLE:
            raise InvalidRequest(field, f"height and width must be multiples of {SIZE_MULTIPLE}, "
                                        f"got {name} {dim}")
    return h, w


# ----------------------------------------------------------------------------------------------- others


def resolve_shift(shift: Any = None, flow_shift: Any = None, params_shift: Any = None,
                  default: float = DEFAULT_SHIFT) -> float:
    """``extra.shift`` wins over its alias ``extra.flow_shift``, then the sampling ``flow_shift``, then ``default``
    (3.0)."""
    for field, value in (("extra.shift", shift), ("extra.flow_shift", flow_shift), ("params.flow_shift", params_shift)):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise InvalidRequest(field, f"shift must be positive, got {value!r}")
            return float(value)
    return default


def resolve_negative_prompt(negative_prompt: str | None, mode: str) -> str:
    """An explicit negative prompt is kept, even ``""``; otherwise the mode's default."""
    if negative_prompt is not None:
        if not isinstance(negative_prompt, str):
            raise InvalidRequest("negative_prompt", f"must be a string, got {type(negative_prompt).__name__}")
        return negative_prompt
    return default_negative_prompt(mode)


def check_num_outputs(n: int) -> None:
    if n != 1:
        raise InvalidRequest("params.num_outputs", f"LingBot returns one output per prompt, got num_outputs={n}")


def check_output_type(output_type: str, mode: str) -> None:
    wanted = "image" if mode == "t2i" else "video"
    if output_type not in ("auto", wanted):
        raise InvalidRequest("params.output_type", f"mode {mode} produces {wanted} output, not {output_type}")


#: Device types on which ``batch_cfg`` left to the platform (absent or ``"auto"``) packs CFG into one B=2N forward.
PACKED_CFG_DEVICES = frozenset({"cuda", "npu"})


def platform_batch_cfg(device_type: str) -> bool:
    """What ``batch_cfg: "auto"`` (the default) picks on ``device_type``: packed on CUDA/NPU, two passes elsewhere.

    Measured, not assumed, on CPU: ``benchmarks/lingbot_batch_cfg.py`` times the packed B=2 forward at 1.17x
    (dense) and 1.26x (MoE) the two B=1 forwards at 1.5k video tokens, so a CPU deployment runs two passes. On an
    accelerator the packed forward is the point (one launch sequence for both branches, a fuller device); that
    side is unverified here (no GPU was measured)."""
    return device_type in PACKED_CFG_DEVICES


def resolve_batch_cfg(extra: Mapping[str, Any], device_type: str) -> tuple[bool, str]:
    """``(packed, source)`` for ``extra.batch_cfg``: an explicit true/false is kept (source ``"request"``);
    absent or ``"auto"`` takes :func:`platform_batch_cfg` (source ``"auto"``)."""
    value = extra.get("batch_cfg", "auto")
    if value == "auto":
        return platform_batch_cfg(device_type), "auto"
    if not isinstance(value, bool):
        raise InvalidRequest("extra.batch_cfg", f'must be true or false (or "auto": the platform\'s choice), '
                                                f"got {value!r}")
    return value, "request"


@attrs.frozen
class LowNoiseOptions:
    """A low-noise schedule request: start at ``threshold`` (in (0, 1]) plus ``tail_steps`` extra sigmas."""

    threshold: float | None = None
    tail_steps: int = DEFAULT_SIGMA_TAIL_STEPS


def resolve_low_noise(extra: Mapping[str, Any]) -> LowNoiseOptions:
    threshold = extra.get("base_low_noise_threshold", extra.get("t_thresh"))
    field = "extra.base_low_noise_threshold" if "base_low_noise_threshold" in extra else "extra.t_thresh"
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
            raise InvalidRequest(field, f"must be in (0, 1], got {threshold!r}")
        threshold = float(threshold)
    tail = extra.get("base_sigma_tail_steps", DEFAULT_SIGMA_TAIL_STEPS)
    if isinstance(tail, bool) or not isinstance(tail, int) or tail < 0:
        raise InvalidRequest("extra.base_sigma_tail_steps", f"must be a non-negative integer, got {tail!r}")
    if tail > MAX_SCHEDULE_STEPS:  # each tail point is one more DiT evaluation
        raise InvalidRequest("extra.base_sigma_tail_steps", f"must be at most {MAX_SCHEDULE_STEPS}, got {tail}")
    return LowNoiseOptions(threshold, tail)


@attrs.frozen
class ResolvedRequest:
    """Everything the pipeline needs from one request, normalised."""

    mode: str
    caption: str
    negative_prompt: str
    height: int
    width: int
    num_frames: int
    fps: float
    shift: float
    batch_cfg: bool
    null_cond_clone_zero: bool
    low_noise: LowNoiseOptions
    refiner: RefinerOptions | None = None
    vae_tiling: VaeTiling | None = None
    batch_cfg_source: str = "request"  # "request" (explicit true/false) or "auto" (the platform's choice)


def resolve_request(
    *,
    prompt: str | Mapping[str, Any],
    negative_prompt: str | None,
    modalities: Sequence[str] | None,
    num_images: int,
    num_videos: int,
    num_audios: int,
    params: Any,
    extra: Mapping[str, Any],
    defaults: Any = None,
    device_type: str = "cpu",
) -> ResolvedRequest:
    """Apply every rule to one request (``params`` is an omnicore ``SamplingParams``; ``defaults`` the served
    ``RequestDefaults`` — a preset's may be smaller — else the model's own 480x480, 81 frames, 24 fps, shift 3;
    ``device_type`` the DiT's device, which decides ``batch_cfg: "auto"``)."""
    default_h = DEFAULT_HEIGHT if defaults is None else defaults.height
    default_w = DEFAULT_WIDTH if defaults is None else defaults.width
    default_frames = DEFAULT_NUM_FRAMES if defaults is None else defaults.num_frames
    default_fps = DEFAULT_FPS if defaults is None else float(defaults.fps)
    default_shift = DEFAULT_SHIFT if defaults is None or defaults.flow_shift is None else defaults.flow_shift
    mode = resolve_mode(modalities, num_images, num_videos=num_videos, num_audios=num_audios,
                        output_type=params.output_type)
    check_num_outputs(params.num_outputs)
    check_output_type(params.output_type, mode)
    caption = resolve_caption(prompt)
    pdict: Mapping[str, Any] = prompt if isinstance(prompt, Mapping) else {}

    fps_src = pdict.get("fps", params.fps)
    fps = default_fps if fps_src is None else float(check_fps(fps_src, "prompt.fps" if "fps" in pdict else "fps"))
    explicit = (("prompt.num_frames", pdict["num_frames"]) if pdict.get("num_frames") is not None
                else ("params.num_frames", params.num_frames) if params.num_frames is not None else None)
    duration = pick_duration(pdict, extra, params.duration)
    num_frames = resolve_num_frames(mode, explicit, duration, fps, default_frames)

    from_prompt = resolve_size(width=pdict.get("width"), height=pdict.get("height"), size=pdict.get("size"),
                               resolution=pdict.get("resolution"), ratio=pdict.get("ratio"), source="prompt.")
    from_request = resolve_size(width=params.width, height=params.height, size=extra.get("size"),
                                resolution=extra.get("resolution"), ratio=pick_ratio(extra, ""), source="")
    height, width = from_prompt or from_request or (default_h, default_w)
    batch_cfg, batch_cfg_source = resolve_batch_cfg(extra, device_type)

    return ResolvedRequest(
        mode=mode,
        caption=caption,
        # the request field wins; ``extra.negative_prompt`` is accepted for clients of the reference's format
        negative_prompt=resolve_negative_prompt(
            negative_prompt if negative_prompt is not None else extra.get("negative_prompt"), mode),
        height=height,
        width=width,
        num_frames=num_frames,
        fps=fps,
        shift=resolve_shift(extra.get("shift"), extra.get("flow_shift"), params.flow_shift, default_shift),
        batch_cfg=batch_cfg,
        batch_cfg_source=batch_cfg_source,
        null_cond_clone_zero=extra_bool(extra, "null_cond_clone_zero", False),
        low_noise=resolve_low_noise(extra),
        refiner=resolve_refiner(extra, mode),
        vae_tiling=resolve_vae_tiling(extra),
    )
