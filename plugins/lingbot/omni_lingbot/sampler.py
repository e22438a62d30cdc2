"""The FlowUniPC sampler, on top of diffusers' ``UniPCMultistepScheduler``.

diffusers' flow-sigma grid is ``linspace(1, 1/1000, N+1)[:-1]`` (and nudges a leading 1.0 by 1e-6); LingBot's
is ``linspace(sigma_max, sigma_min=0, N+1)[:-1]`` where ``sigma_max`` is the *float32* training sigma 0.999
(0.9990000128746033), so the default grid differs. Everything else is the same math (x0 = sample - sigma * v,
UniPC-bh2 predictor-corrector, lower-order final, final sigma 0, int64 timesteps by truncation), so we compute
the sigma grid ourselves, hand it to diffusers with ``flow_shift=1`` (which makes diffusers' own shift the
identity) and then set the timesteps from our grid exactly as the reference does.

Precision follows the reference step by step, because the timesteps are *truncated* and so move by one on tiny
differences: the base grid is float64 (``linspace`` from the float32 ``sigma_max``), the low-noise grid is cast
to float32 before its timesteps are taken (``float32 sigma * 1000`` in float32). At shift 1.0 and N = 3 the
float32 ``sigma_max`` makes the last timestep 333, where an exact 0.999 would give 332.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

NUM_TRAIN_TIMESTEPS = 1000

#: The values the release's sampler fixes; a checkpoint's scheduler_config.json may not override them.
_FORCED = {
    "use_flow_sigmas": True,
    "prediction_type": "flow_prediction",
    "flow_shift": 1.0,
    "use_dynamic_shifting": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "final_sigmas_type": "zero",
}
_DEFAULTS = {
    "num_train_timesteps": NUM_TRAIN_TIMESTEPS,
    "solver_order": 2,
    "predict_x0": True,
    "solver_type": "bh2",
    "lower_order_final": True,
}


def sigma_bounds(num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> tuple[float, float]:
    """Training sigmas are ``1 - linspace(1, 1/T, T)[::-1]`` stored as float32: max ``float32(1 - 1/T)``
    (0.9990000128746033 for T = 1000, not 0.999), min 0."""
    train = (1.0 - np.linspace(1.0, 1.0 / num_train_timesteps, num_train_timesteps)[::-1]).astype(np.float32)
    return float(train[0]), float(train[-1])


def shift_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """The flow shift ``s*b / (1 + (s-1)*b)``."""
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def base_sigmas(num_steps: int, shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> np.ndarray:
    """The shifted schedule of ``num_steps`` sigmas (final 0 not included)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    hi, lo = sigma_bounds(num_train_timesteps)
    return shift_sigmas(np.linspace(hi, lo, num_steps + 1)[:-1], shift)


def low_noise_sigmas(
    num_steps: int, shift: float, threshold: float, tail_steps: int,
    num_train_timesteps: int = NUM_TRAIN_TIMESTEPS,
) -> np.ndarray:
    """The refiner-style schedule: the shifted grid cut at ``threshold`` plus ``tail_steps`` extra points.

    Keeps sigmas ``<= threshold (+1e-6)``, puts ``threshold`` first when the cut missed it, then appends
    ``tail_steps`` points spaced evenly between the last kept sigma and ``min(sigma_min, last)``. Returned as
    float32, the precision the reference hands its sampler (its timesteps are taken from the float32 values).
    """
    _, lo = sigma_bounds(num_train_timesteps)
    full = base_sigmas(num_steps, shift, num_train_timesteps)
    kept = [float(s) for s in full if s <= threshold + 1e-6]
    if not kept or abs(kept[0] - threshold) > 1e-6:
        kept.insert(0, float(threshold))
    last = kept[-1]
    tail = np.linspace(last, min(lo, last), tail_steps + 2)[1:-1] if tail_steps > 0 else np.zeros(0)
    return np.asarray(kept + [float(t) for t in tail], dtype=np.float32)


def read_scheduler_config(path: Path | None) -> dict[str, Any]:
    """``scheduler_config.json`` with the sampler's fixed values applied on top (unknown keys are left to diffusers)."""
    config = dict(_DEFAULTS)
    if path is not None and path.is_file():
        raw = json.loads(path.read_text())
        config.update({k: v for k, v in raw.items() if not k.startswith("_") and k != "shift"})
    config.update(_FORCED)
    return config


def reference_timesteps(sigmas: np.ndarray, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS) -> np.ndarray:
    """``sigmas * T`` in the grid's own precision, truncated to int64 (float32 grids multiply in float32)."""
    grid = np.asarray(sigmas)
    return (grid * grid.dtype.type(num_train_timesteps)).astype(np.int64)


def make_scheduler(config: dict[str, Any], sigmas: np.ndarray) -> Any:
    """A fresh diffusers UniPC scheduler (per batch: it keeps multistep history) set to ``sigmas``.

    The sampler's sigmas and timesteps are then set from ``sigmas`` as the reference computes them (float32
    sigmas with a final 0, :func:`reference_timesteps`), which also undoes diffusers' nudge of a leading 1.0.
    """
    import torch
    from diffusers import UniPCMultistepScheduler

    grid = np.asarray(sigmas)
    if grid.dtype not in (np.float32, np.float64):
        grid = grid.astype(np.float64)
    scheduler = UniPCMultistepScheduler.from_config(config)
    scheduler.set_timesteps(sigmas=grid.copy())
    scheduler.sigmas = torch.from_numpy(np.concatenate([grid, [0.0]]).astype(np.float32))
    scheduler.timesteps = torch.from_numpy(reference_timesteps(grid, int(config["num_train_timesteps"])))
    # we always start at index 0; without this diffusers finds the start by the first timestep's *value*, and
    # picks its second occurrence when two truncated timesteps are equal (possible on low-noise grids)
    scheduler.set_begin_index(0)
    return scheduler


def model_timestep(timestep: Any, dtype: Any = None) -> Any:
    """The DiT input for a scheduler timestep, as the reference computes it for a DiT whose weights are ``dtype``:
    ``sigma = t / 1000`` in float32; for a bf16/fp16 DiT sigma is cast to that dtype and multiplied by 1000 *in that
    dtype* (so the product is rounded again), for any other dtype (float32) nothing is rounded.
    Returned as float32. ``dtype=None`` means float32."""
    import torch

    sigma = torch.as_tensor(timestep).float() / float(NUM_TRAIN_TIMESTEPS)
    if dtype in (torch.bfloat16, torch.float16):
        sigma = sigma.to(dtype)
    return (sigma * float(NUM_TRAIN_TIMESTEPS)).float()


#: What ``UniPCMultistepScheduler.step`` changes between steps: per-sample history (batch-first rows) and counters.
_ROW_LISTS = ("model_outputs",)
_ROW_TENSORS = ("last_sample",)
_COUNTERS = ("timestep_list", "lower_order_nums", "this_order", "_step_index")


def scheduler_state(scheduler: Any, row: int) -> dict[str, Any]:
    """The multistep history of sample ``row`` and the sampler's counters (a step checkpoint's sampler part)."""
    out: dict[str, Any] = {}
    for name in _ROW_LISTS:
        out[name] = [None if m is None else m[row:row + 1] for m in getattr(scheduler, name)]
    for name in _ROW_TENSORS:
        value = getattr(scheduler, name)
        out[name] = None if value is None else value[row:row + 1]
    for name in _COUNTERS:
        if hasattr(scheduler, name):  # ``this_order`` exists only after the first step
            out[name] = getattr(scheduler, name)
    return out


def restore_scheduler_state(scheduler: Any, saved: dict[str, Any], device: Any) -> None:
    """Put :func:`scheduler_state`'s values back into a fresh scheduler of the same schedule."""
    for name, value in saved.items():
        if name in _ROW_LISTS:
            value = [None if m is None else m.to(device) for m in value]
        elif name in _ROW_TENSORS:
            value = None if value is None else value.to(device)
        elif name not in _COUNTERS:
            raise ValueError(f"unknown sampler field {name!r} in a step checkpoint")
        setattr(scheduler, name, value)
