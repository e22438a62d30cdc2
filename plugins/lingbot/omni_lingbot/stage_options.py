"""Request options of the two optional stages: the MoE package's refiner and VAE tiling.

Pure functions over ``GenerationRequest.extra`` (no torch): each returns a frozen, hashable record or ``None``
when the stage is off, or raises :class:`omnicore.errors.InvalidRequest` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
from omnicore.plugin import InvalidRequest

#: Refiner fields (docs/contracts-status.md C8.1); every one but ``run_refiner`` needs it to be true.
REFINER_FIELDS = (
    "run_refiner", "refiner_height", "refiner_width", "refiner_steps", "refiner_guidance_scale", "refiner_shift",
    "refiner_t_thresh", "refiner_sigma_tail_steps", "refiner_sample_fps", "refiner_null_cond_clone_zero",
    "refiner_output_fps", "refiner_max_video_frames", "refiner_batch_cfg",
)
#: VAE tiling fields; a tile size without ``vae_tiling`` turns tiling on.
TILING_FIELDS = (
    "vae_tiling", "vae_tile_sample_min_height", "vae_tile_sample_min_width", "vae_tile_sample_stride_height",
    "vae_tile_sample_stride_width",
)
REFINER_SIZE_MULTIPLE = 16  # VAE 8x and DiT patch 2x
#: At most this many refiner steps / tail steps: the scheduler has 1000 training timesteps, so a finer grid only
#: repeats its (integer) timesteps. The refiner's size and steps are further bounded by the work budget: the
#: pipeline declares the stage to the engine (refiner.refiner_stage), which checks it with the request's limits.
MAX_SCHEDULE_STEPS = 1000
TILE_MULTIPLE = 8  # one latent cell of the Wan VAE


@attrs.frozen
class RefinerOptions:
    """How to run the refiner stage (defaults of the upstream MoE package)."""

    height: int = 1088
    width: int = 1920
    steps: int = 8
    guidance_scale: float = 3.0
    shift: float = 3.0
    t_thresh: float = 0.85
    sigma_tail_steps: int = 2
    sample_fps: float = 24.0
    null_cond_clone_zero: bool = True
    output_fps: float | None = None  # the refined video's frame rate; None = sample_fps (both 24 upstream)
    max_video_frames: int | None = None  # cap on the refiner clip's frames (1 or 4n+1); None = no cap
    batch_cfg: bool = False  # the refiner's own batch-CFG switch (independent of the base stage's batch_cfg)

    @property
    def fps(self) -> float:
        """The frame rate the refined video is written with."""
        return self.output_fps if self.output_fps is not None else self.sample_fps


@attrs.frozen
class VaeTiling:
    """Spatial VAE tiling in pixels (diffusers ``AutoencoderKLWan.enable_tiling`` arguments)."""

    min_height: int = 256
    min_width: int = 256
    stride_height: int = 192
    stride_width: int = 192


def extra_bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    """``extra[key]`` (``default`` when absent), which must be a JSON boolean."""
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise InvalidRequest(f"extra.{key}", f"must be true or false, got {value!r}")
    return value


def _int(extra: Mapping[str, Any], key: str, default: int, *, low: int, multiple: int = 1,
         high: int | None = None) -> int:
    value = extra.get(key, default)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)  # JSON clients may send 1088.0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise InvalidRequest(f"extra.{key}", f"must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise InvalidRequest(f"extra.{key}", f"must be at most {high}, got {value}")
    if value % multiple:
        raise InvalidRequest(f"extra.{key}", f"must be a multiple of {multiple}, got {value}")
    return value


def _number(extra: Mapping[str, Any], key: str, default: float, *, low: float, high: float = math.inf,
            low_open: bool = False, high_open: bool = False) -> float:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequest(f"extra.{key}", f"must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if too_low or too_high:
        bounds = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or high == math.inf else ']'}"
        raise InvalidRequest(f"extra.{key}", f"must be in {bounds}, got {value!r}")
    return float(value)


def resolve_refiner(extra: Mapping[str, Any], mode: str) -> RefinerOptions | None:
    """The refiner options when ``extra.run_refiner`` is true, else ``None``.

    A ``refiner_*`` field without ``run_refiner: true`` is rejected rather than ignored (it would have no
    effect), and so is ``refiner_sample_fps`` for text-to-image, which has no frame rate.
    """
    run = extra_bool(extra, "run_refiner", False)
    given = [k for k in REFINER_FIELDS[1:] if k in extra]
    if not run:
        if given:
            raise InvalidRequest(f"extra.{given[0]}", "refiner options need extra.run_refiner=true")
        return None
    if mode == "t2i":
        for key in ("refiner_sample_fps", "refiner_output_fps", "refiner_max_video_frames"):
            if key in extra:
                raise InvalidRequest(f"extra.{key}", "text-to-image has no frame rate or clip to resample")
    max_frames = extra.get("refiner_max_video_frames")
    if max_frames is not None:
        max_frames = _int(extra, "refiner_max_video_frames", 1, low=1)
        if (max_frames - 1) % 4:
            raise InvalidRequest("extra.refiner_max_video_frames",
                                 f"must be 1 or 4n+1 (the causal VAE's clip lengths), got {max_frames}")
    output_fps = extra.get("refiner_output_fps")
    if output_fps is not None:
        output_fps = _number(extra, "refiner_output_fps", 24.0, low=0.0, low_open=True)
    d = RefinerOptions()
    return RefinerOptions(
        height=_int(extra, "refiner_height", d.height, low=REFINER_SIZE_MULTIPLE, multiple=REFINER_SIZE_MULTIPLE),
        width=_int(extra, "refiner_width", d.width, low=REFINER_SIZE_MULTIPLE, multiple=REFINER_SIZE_MULTIPLE),
        steps=_int(extra, "refiner_steps", d.steps, low=1, high=MAX_SCHEDULE_STEPS),
        guidance_scale=_number(extra, "refiner_guidance_scale", d.guidance_scale, low=0.0),
        shift=_number(extra, "refiner_shift", d.shift, low=0.0, low_open=True),
        t_thresh=_number(extra, "refiner_t_thresh", d.t_thresh, low=0.0, high=1.0, low_open=True),
        sigma_tail_steps=_int(extra, "refiner_sigma_tail_steps", d.sigma_tail_steps, low=0, high=MAX_SCHEDULE_STEPS),
        sample_fps=_number(extra, "refiner_sample_fps", d.sample_fps, low=0.0, low_open=True),
        null_cond_clone_zero=extra_bool(extra, "refiner_null_cond_clone_zero", d.null_cond_clone_zero),
        output_fps=output_fps,
        max_video_frames=max_frames,
        batch_cfg=extra_bool(extra, "refiner_batch_cfg", d.batch_cfg),
    )


def resolve_vae_tiling(extra: Mapping[str, Any]) -> VaeTiling | None:
    """Tiling for every VAE call of the request, or ``None`` (the default: untiled).

    Tile sizes are pixels, multiples of 8, and a stride may not exceed its tile (tiles must touch or overlap).
    Giving a size turns tiling on; giving one together with ``vae_tiling: false`` is a contradiction.
    """
    sizes = [k for k in TILING_FIELDS[1:] if k in extra]
    enabled = extra.get("vae_tiling")
    if enabled is not None and not isinstance(enabled, bool):
        raise InvalidRequest("extra.vae_tiling", f"must be true or false, got {enabled!r}")
    if enabled is False:
        if sizes:
            raise InvalidRequest(f"extra.{sizes[0]}", "tile sizes contradict extra.vae_tiling=false")
        return None
    if enabled is None and not sizes:
        return None
    d = VaeTiling()
    tiling = VaeTiling(*(_int(extra, key, default, low=TILE_MULTIPLE, multiple=TILE_MULTIPLE)
                         for key, default in zip(TILING_FIELDS[1:], attrs.astuple(d))))
    for axis, tile, stride in (("height", tiling.min_height, tiling.stride_height),
                               ("width", tiling.min_width, tiling.stride_width)):
        if stride > tile:
            raise InvalidRequest(f"extra.vae_tile_sample_stride_{axis}",
                                 f"must not exceed vae_tile_sample_min_{axis} ({tile}), got {stride}")
    return tiling
