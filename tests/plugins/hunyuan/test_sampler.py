"""HunyuanImage-3's initial noise and timestep grids against the reference's rules: the noise is drawn in bf16 from
the request's generator; the release grid is the default and diffusers' FlowMatchEulerDiscreteScheduler grid (the
reference serving system's) is a model option, checked against the diffusers scheduler installed here."""

from __future__ import annotations

import pytest
import torch
from _hunyuan_helpers import request, run
from omni_hunyuan.sampler import model_timesteps, sigmas
from omnicore.errors import ConfigError


def _pipe_with(pipe, **kwargs):
    from omni_hunyuan.pipeline import HunyuanImage3Pipeline

    return HunyuanImage3Pipeline(pipe.model, pipe.tokenizer, pipe.gen_config, device=pipe.device, dtype=pipe.dtype,
                                 **kwargs)


def test_initial_noise_is_bf16_randn_of_the_request_generator(pipe):
    state = pipe.encode([pipe.preprocess(request(seed=11))])
    shape = tuple(state.latents.shape)
    assert shape == (1, pipe.config.latent_channels, 4, 4) and state.latents.dtype == torch.float32
    want = torch.randn(shape, generator=torch.Generator().manual_seed(11), dtype=torch.bfloat16).float()
    assert torch.equal(state.latents, want)
    fp32 = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    assert not torch.equal(state.latents, fp32)  # an fp32 draw is another image for the same seed


def test_batched_requests_each_draw_from_their_own_seed(pipe):
    state = pipe.encode([pipe.preprocess(request(seed=s)) for s in (3, 4)])
    for row, seed in enumerate((3, 4)):
        want = torch.randn(state.latents.shape[1:], generator=torch.Generator().manual_seed(seed),
                           dtype=torch.bfloat16).float()
        assert torch.equal(state.latents[row], want)


def _diffusers_schedule(steps: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    from diffusers import FlowMatchEulerDiscreteScheduler  # a dependency of the LingBot plugin, always installed

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift,
                                                use_dynamic_shifting=False)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas, scheduler.timesteps


@pytest.mark.parametrize(("steps", "shift"), [(3, 3.0), (50, 3.0), (1, 3.0), (7, 5.5), (20, 1.0), (28, 12.0)])
def test_diffusers_grid_equals_the_installed_scheduler(steps, shift):
    ref_sigmas, ref_timesteps = _diffusers_schedule(steps, shift)
    grid = sigmas(steps, shift, "diffusers")
    assert torch.equal(grid.to(torch.float32), ref_sigmas)
    assert torch.equal(model_timesteps(grid).to(torch.float32), ref_timesteps)  # what the model is fed (fp32)


def test_the_two_grids_differ_at_the_low_end():
    diffusers_t = model_timesteps(sigmas(3, 3.0, "diffusers"))
    assert torch.allclose(diffusers_t, torch.tensor([1000.0, 751.1, 8.93], dtype=torch.float64), atol=0.05)
    release = model_timesteps(sigmas(50, 3.0))  # the default: shifted once
    assert torch.allclose(release[-3:], torch.tensor([160.7, 111.1, 57.7], dtype=torch.float64), atol=0.05)
    assert torch.allclose(model_timesteps(sigmas(50, 3.0, "diffusers"))[-3:],
                          torch.tensor([120.5, 66.9, 8.93], dtype=torch.float64), atol=0.05)
    with pytest.raises(ValueError, match="sampler_grid"):
        sigmas(3, 3.0, "karras")


def test_sampler_grid_option_drives_the_denoise_loop(pipe):
    assert pipe.sampler_grid == "release"
    alt = _pipe_with(pipe, sampler_grid="diffusers")
    ref_sigmas, ref_timesteps = _diffusers_schedule(3, 3.0)
    a, _ = run(alt, request(num_inference_steps=3), decode=False)
    assert torch.equal(a.timesteps.to(torch.float32), ref_timesteps)
    assert torch.equal(torch.tensor(a.extras["sigmas"], dtype=torch.float32), ref_sigmas)
    b, _ = run(pipe, request(num_inference_steps=3), decode=False)
    assert torch.equal(b.timesteps, model_timesteps(sigmas(3, 3.0)))
    assert not torch.allclose(a.latents, b.latents)  # the grid really reaches the sampler
    with pytest.raises(ConfigError, match="sampler_grid"):
        _pipe_with(pipe, sampler_grid="karras")


def test_sampler_grid_is_a_declared_model_option():
    from omni_hunyuan.plugin import MODEL_SPEC

    (option,) = [o for o in MODEL_SPEC.options if o.name == "sampler_grid"]
    assert option.default == "release" and option.choices == ("release", "diffusers")
