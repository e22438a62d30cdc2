"""Schedule keys of the exact-schedule AdaLN cache: float32 timesteps identified by their bit patterns.

Two schedules share modulation tables exactly when every step has the same float32 unique timesteps, so
the key is the tuple over steps of the signed int32 reinterpretation of those values. Keys are built from
host-side tuples only; building one never reads a device tensor (no host/device synchronisation).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

ScheduleKey = tuple[tuple[int, ...], ...]


def _check_cpu_float32(values: object) -> None:
    if not isinstance(values, torch.Tensor) or values.dtype != torch.float32 or values.device.type != "cpu":
        raise ValueError("schedule key values must be a CPU float32 tensor")


def float32_bits(values: torch.Tensor) -> tuple[int, ...]:
    """The signed int32 bit pattern of each element of a CPU float32 tensor."""
    _check_cpu_float32(values)
    return tuple(int(b) for b in values.detach().contiguous().reshape(-1).view(torch.int32).tolist())


@attrs.frozen
class StepTimesteps:
    """One denoise step's distinct timesteps: ``unique_timesteps`` (float32, ascending, on the model's device),
    ``inverse_indices`` (row → index into ``unique_timesteps``, optional) and ``timestep_bits`` (host copy)."""

    unique_timesteps: torch.Tensor
    timestep_bits: tuple[int, ...]
    inverse_indices: torch.Tensor | None = None


def step_timesteps(row_timesteps: torch.Tensor, device: torch.device | str | None = None) -> StepTimesteps:
    """Unique sorted timesteps (with inverse) of one step from its CPU float32 per-row timesteps."""
    _check_cpu_float32(row_timesteps)
    unique, inverse = torch.unique(row_timesteps, sorted=True, return_inverse=True)
    return StepTimesteps(
        unique_timesteps=unique.to(device) if device is not None else unique,
        timestep_bits=float32_bits(unique),
        inverse_indices=inverse.to(device) if device is not None else inverse,
    )


def schedule_key(steps: Sequence[object]) -> ScheduleKey:
    """Key of a whole schedule from per-step metadata carrying host ``timestep_bits``."""
    if len(steps) == 0:
        raise ValueError("AdaLN schedule must contain at least one denoise step")
    key = []
    for meta in steps:
        bits = meta.get("timestep_bits") if isinstance(meta, dict) else getattr(meta, "timestep_bits", None)
        if bits is None:
            raise ValueError("timestep metadata is missing host timestep_bits")
        key.append(tuple(int(b) for b in bits))
    return tuple(key)
