"""FlowUniPC schedule: the sigma grid, truncated timesteps, sampler consistency, bf16 t_in."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from omni_lingbot.sampler import (
    base_sigmas,
    low_noise_sigmas,
    make_scheduler,
    model_timestep,
    read_scheduler_config,
)


def _reference_grid(n: int, shift: float) -> tuple[list[float], list[int]]:
    """The sigma schedule written out with plain Python floats: sigmas from float32 0.999 down (N of N+1 points), shifted."""
    sig_max, sig_min = struct.unpack("<f", struct.pack("<f", 1.0 - 1.0 / 1000))[0], 0.0  # float32 0.999
    sigmas = []
    for i in range(n):
        b = sig_max + (sig_min - sig_max) * i / n
        sigmas.append(shift * b / (1 + (shift - 1) * b))
    return sigmas, [int(s * 1000) for s in sigmas]  # int() truncates


@pytest.mark.parametrize(("steps", "shift"), [(4, 3.0), (40, 3.0), (7, 1.0), (10, 12.0)])
def test_sigmas_and_timesteps_follow_the_reference(steps, shift):
    scheduler = make_scheduler(read_scheduler_config(None), base_sigmas(steps, shift))
    sigmas, timesteps = _reference_grid(steps, shift)
    assert scheduler.timesteps.dtype == torch.int64
    assert scheduler.timesteps.tolist() == timesteps
    np.testing.assert_allclose(scheduler.sigmas[:-1].numpy(), sigmas, rtol=0, atol=1e-7)
    assert float(scheduler.sigmas[-1]) == 0.0  # final sigma is zero
    assert len(scheduler.sigmas) == steps + 1


def test_default_diffusers_grid_is_not_ours():
    """Why we pass sigmas explicitly: diffusers' own flow grid starts at 1.0 - 1e-6, not 0.999."""
    from diffusers import UniPCMultistepScheduler

    theirs = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0)
    theirs.set_timesteps(4)
    ours = make_scheduler(read_scheduler_config(None), base_sigmas(4, 3.0))
    assert theirs.timesteps.tolist() != ours.timesteps.tolist()


@pytest.mark.parametrize("steps", [1, 2, 5, 12])
def test_exact_velocity_stays_on_the_flow_line(steps):
    """With the true velocity v = noise - x0 every UniPC step must land on x_s = (1-s) x0 + s noise."""
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(2, 4, 3, 4, 4, generator=gen)
    noise = torch.randn(2, 4, 3, 4, 4, generator=gen)
    scheduler = make_scheduler(read_scheduler_config(None), base_sigmas(steps, 3.0))
    sig = scheduler.sigmas
    x = (1 - sig[0]) * x0 + sig[0] * noise
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(noise - x0, t, x).prev_sample
        expected = (1 - sig[i + 1]) * x0 + sig[i + 1] * noise
        torch.testing.assert_close(x, expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(x, x0, atol=2e-6, rtol=0)  # final sigma 0 -> the data


def test_second_order_differs_from_euler():
    """The multistep solver really uses history: a velocity that changes between steps is not integrated
    like plain Euler (guards against a silently first-order configuration)."""
    scheduler = make_scheduler(read_scheduler_config(None), base_sigmas(4, 3.0))
    assert scheduler.config.solver_order == 2 and scheduler.config.solver_type == "bh2"
    assert scheduler.config.predict_x0 and scheduler.config.lower_order_final
    sig = scheduler.sigmas
    x = torch.ones(1, 1, 1, 2, 2)
    euler = x.clone()
    for i, t in enumerate(scheduler.timesteps):
        v = torch.full_like(x, float(i + 1))
        x = scheduler.step(v, t, x).prev_sample
        euler = euler + (sig[i + 1] - sig[i]) * v
    assert not torch.allclose(x, euler, atol=1e-4)


def test_low_noise_schedule():
    s = low_noise_sigmas(10, 3.0, 0.85, 2)
    full = base_sigmas(10, 3.0)
    kept = [x for x in full if x <= 0.85 + 1e-6]
    assert s[0] == pytest.approx(0.85)  # the threshold is prepended when the grid misses it
    np.testing.assert_allclose(s[1:1 + len(kept)], kept)
    last = kept[-1]
    np.testing.assert_allclose(s[1 + len(kept):], [last * 2 / 3, last * 1 / 3])  # tail towards sigma_min 0
    assert len(s) == 1 + len(kept) + 2
    assert s.dtype == np.float32  # the reference casts the low-noise grid to float32 before taking timesteps
    scheduler = make_scheduler(read_scheduler_config(None), s)
    assert scheduler.timesteps.tolist() == [int(np.float32(x) * np.float32(1000)) for x in s]
    assert len(low_noise_sigmas(10, 3.0, 0.85, 0)) == 1 + len(kept)


def _bf16_round(x: float) -> float:
    """Round-to-nearest-even to bfloat16 on the float32 bit pattern."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


@pytest.mark.parametrize("t", [999, 899, 749, 499, 123, 1])
def test_model_timestep_bf16_rounds_sigma_and_the_product(t):
    """A bf16 DiT: sigma = t/1000 rounded to bf16, times 1000 in bf16 (the product rounded again)."""
    sigma = _bf16_round(_f32(t / 1000))
    assert model_timestep(torch.tensor(t), torch.bfloat16).item() == _bf16_round(sigma * 1000)
    assert model_timestep(torch.tensor(t), torch.bfloat16).dtype == torch.float32


def test_model_timestep_per_dtype_worked_values():
    # 999: sigma 0.999 -> bf16 1.0 -> 1000; 123: 0.123 -> bf16 0.123046875 -> x1000 = 123.046875 -> bf16 123.0
    assert model_timestep(torch.tensor(999), torch.bfloat16).item() == 1000.0
    assert model_timestep(torch.tensor(123), torch.bfloat16).item() == 123.0
    # 749: 0.749 -> bf16 0.75 -> 750 exactly; with the old fp32 product it was also 750, but 499 differs:
    # 0.499 -> bf16 0.498046875 -> x1000 = 498.046875 -> bf16 498.0 (fp32 product would keep 498.046875)
    assert model_timestep(torch.tensor(499), torch.bfloat16).item() == 498.0
    # fp16 rounds in fp16 (10-bit mantissa): 0.123 -> 0.12298583984375 -> x1000 = 122.98583984375 -> fp16 123.0
    assert model_timestep(torch.tensor(123), torch.float16).item() == 123.0


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_model_timestep_fp32_does_not_round(dtype):
    """A float32 DiT gets t/1000*1000 in float32: no bf16 rounding at all (integer t comes back within 1 ulp)."""
    t = torch.arange(1, 1001)
    got = model_timestep(t, dtype)
    assert got.dtype == torch.float32
    assert torch.allclose(got, t.float(), rtol=0, atol=1e-4)
    bf16 = model_timestep(t, torch.bfloat16)
    assert (bf16 != t.float()).sum().item() == 500  # bf16 has 8 mantissa bits: half the integers move
    assert (bf16 - t.float()).abs().max().item() == 3.0
    # rounding only sigma (and multiplying in fp32), as before issue 14, is yet another input for 994 of them
    sigma_only = (t.float() / 1000).to(torch.bfloat16).float() * 1000
    assert (sigma_only != bf16).sum().item() == 994
    assert (sigma_only - bf16).abs().max().item() == 2.0


def test_shift_one_thirds_come_from_the_float32_sigma_max():
    """sigma_max is the float32 training sigma 0.999 (0.99900001...): at shift 1 and 3 steps the last timestep is
    int(333.000004) = 333, where an exact 0.999 would give int(332.99999999999994) = 332."""
    scheduler = make_scheduler(read_scheduler_config(None), base_sigmas(3, 1.0))
    assert scheduler.timesteps.tolist() == [999, 666, 333]
    assert base_sigmas(3, 1.0)[0] == _f32(0.999) != 0.999


def test_scheduler_config_forces_flow_settings(tmp_path):
    (tmp_path / "scheduler_config.json").write_text(
        '{"_class_name": "FlowUniPCMultistepScheduler", "shift": 5.0, "solver_order": 3, '
        '"prediction_type": "epsilon", "use_flow_sigmas": false}')
    cfg = read_scheduler_config(tmp_path / "scheduler_config.json")
    assert cfg["solver_order"] == 3  # checkpoint values pass through
    assert cfg["prediction_type"] == "flow_prediction" and cfg["use_flow_sigmas"] is True
    assert cfg["flow_shift"] == 1.0 and "shift" not in cfg  # the request's shift is applied to our grid
