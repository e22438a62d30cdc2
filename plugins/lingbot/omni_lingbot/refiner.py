"""The MoE package's refiner stage: from a decoded base video to the refiner's start latents.

Per request: decode the base latents → pick frames at ``sample_fps`` (at most ``max_video_frames``) → bicubic
resize to the refiner size → VAE encode (posterior sampled) → for TI2V, the clean first latent frame from the
original reference image → mix with noise at the refiner's starting sigma ``t``: ``x = (1 - t) * x_up + t * noise``.
The refiner DiT then denoises along :func:`refiner_sigmas`.

Randomness comes from a generator of its own per request, seeded with :func:`refiner_seed` of the request seed,
and is drawn in a fixed order: the video posterior, then (TI2V) the image posterior, then the noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from omnicore.plugin import MAX_SEED, StageWork
from PIL import Image

from .conditions import apply_clean_prefix
from .plan import plan_of
from .sampler import low_noise_sigmas
from .stage_options import RefinerOptions

_MASK64 = (1 << 64) - 1


def refiner_seed(seed: int) -> int:
    """The refiner's seed: SplitMix64 of the base seed, cut to 63 bits.

    A plain ``seed + 1`` would make request A's refiner noise equal request B's base noise when B's seed is
    A's + 1; one SplitMix64 round is a bijection on 64 bits that spreads neighbouring seeds apart.
    """
    z = (int(seed) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & MAX_SEED


def refiner_sigmas(options: RefinerOptions) -> np.ndarray:
    """The refiner's sigma grid: the low-noise schedule of ``refiner_steps`` shifted steps cut at ``t_thresh``."""
    return low_noise_sigmas(options.steps, options.shift, options.t_thresh, options.sigma_tail_steps)


def clip_length(num_frames: int, fps: float, sample_fps: float, max_frames: int | None = None) -> int:
    """How many base frames the refiner's clip keeps, as the reference budgets it: a clip faster than
    ``sample_fps`` keeps ``raw = int(num_frames / fps * sample_fps)`` frames, a slower one all of them (never
    upsampled); the count is rounded down to ``4k + 1`` for the causal VAE (at least one) and capped at
    ``max_frames`` (``refiner_max_video_frames``)."""
    if num_frames < 1 or fps <= 0 or sample_fps <= 0:
        raise ValueError(f"need num_frames >= 1 and positive rates, got {num_frames}, {fps}, {sample_fps}")
    raw = int(num_frames / fps * sample_fps) if fps > sample_fps else num_frames
    count = max(((raw - 1) // 4) * 4 + 1, 1)
    if max_frames is not None and count > max_frames:
        count = max_frames
    return count


def resample_indices(num_frames: int, fps: float, sample_fps: float, max_frames: int | None = None) -> list[int]:
    """Base-frame indices of the refiner's clip: :func:`clip_length` of them, spread over the clip by
    ``linspace(0, num_frames - 1, count)`` truncated to integers."""
    count = clip_length(num_frames, fps, sample_fps, max_frames)
    return [int(i) for i in np.linspace(0, num_frames - 1, count).astype(np.int64)]


def refiner_stage(options: RefinerOptions, params: Any, extra: Mapping[str, Any]) -> StageWork:
    """The refiner as a stage of the request's work (``params`` are the base stage's, defaults filled): its size,
    its clip length and the DiT evaluations of its schedule. The engine holds it to the same limits as the base
    stage and counts it into the job's work budget (``--max-work``), so ``refiner_height``/``refiner_width``/
    ``refiner_steps`` cannot make a job larger than the budget. Errors name the refiner field the client set."""
    frames = int(params.num_frames or 1)
    if frames > 1:
        frames = clip_length(frames, float(params.fps or options.sample_fps), options.sample_fps,
                             options.max_video_frames)
    given = [k for k in ("refiner_steps", "refiner_height", "refiner_width") if k in extra]
    size_field = "extra.refiner_width" if "refiner_width" in extra and "refiner_height" not in extra \
        else "extra.refiner_height"
    return StageWork(name="refiner", width=options.width, height=options.height, num_frames=frames,
                     steps=len(refiner_sigmas(options)), outputs=int(params.num_outputs or 1),
                     size_field=size_field, steps_field="extra.refiner_steps",
                     work_field=f"extra.{given[0]}" if given else "extra.run_refiner")


def resize_video(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Frames ``[F, H, W, 3]`` in [0, 1] → ``[1, 3, F, height, width]`` (bicubic, clamped to [0, 1])."""
    x = frames.permute(0, 3, 1, 2).float()
    if tuple(x.shape[-2:]) != (height, width):
        x = F.interpolate(x, size=(height, width), mode="bicubic", align_corners=False).clamp(0.0, 1.0)
    return x.permute(1, 0, 2, 3).unsqueeze(0).contiguous()


def first_frame(image: Image.Image, base_height: int, base_width: int, height: int, width: int) -> torch.Tensor:
    """The TI2V reference for the refiner: the original image centre-cropped to the *base* aspect ratio (the
    largest such crop), then bicubic-resized to the refiner size like the video frames. ``[1, 3, 1, H, W]``."""
    rgb = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32) / 255.0)  # [h0, w0, 3]
    h0, w0 = rgb.shape[:2]
    aspect = base_width / base_height
    if w0 / h0 > aspect:
        ch, cw = h0, max(1, min(w0, round(h0 * aspect)))
    else:
        ch, cw = max(1, min(h0, round(w0 / aspect))), w0
    top, left = round((h0 - ch) / 2), round((w0 - cw) / 2)
    return resize_video(rgb[top:top + ch, left:left + cw][None], height, width)


def start_latents(vae: Any, base_latents: torch.Tensor, requests: Sequence[Any], options: RefinerOptions,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The refiner's noisy start latents for a batch (and the TI2V clean prefixes, else ``None``).

    Each request runs the VAE under its own tiling setting (its plan's ``vae_tiling``) and draws from its own
    refiner generator, so a request's result does not depend on its batch.
    """
    starts, cleans = [], []
    for i, request in enumerate(requests):
        p = request.params
        generator = torch.Generator(device=device).manual_seed(refiner_seed(p.seed))
        plan = plan_of(request)
        with vae.tiling(plan.vae_tiling):
            frames = vae.decode(base_latents[i:i + 1])[0]  # [F, H, W, 3] in [0, 1]
            index = resample_indices(frames.shape[0], float(p.fps or options.sample_fps), options.sample_fps,
                                     options.max_video_frames)
            video = resize_video(frames[index], options.height, options.width)
            x_up = vae.encode(video, generator).to(device)
            if plan.mode == "ti2v":
                pixels = first_frame(request.images[0], p.height, p.width, options.height, options.width)
                cleans.append(vae.encode(pixels, generator).to(device))
        noise = torch.randn(x_up.shape, generator=generator, device=device, dtype=torch.float32)
        starts.append((1.0 - options.t_thresh) * x_up + options.t_thresh * noise)
    latents = torch.cat(starts)
    clean = torch.cat(cleans) if cleans else None
    if clean is not None:
        apply_clean_prefix(latents, clean)
    return latents, clean
