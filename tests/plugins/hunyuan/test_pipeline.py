"""The pipeline: request resolution, one clear error per bad input, generation and edits end to end."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _hunyuan_helpers import request, run, square_image
from omnicore.errors import InvalidRequest


def test_defaults_and_resolution(pipe):
    r = pipe.preprocess(request(guidance_scale=None, num_inference_steps=None, height=None, width=None))
    res = r.plan
    assert (r.params.height, r.params.width) == (64, 64)  # the checkpoint's image base size
    assert res.guidance == 5.0 and res.cfg_factor == 2  # guidance 5.0 when not given: CFG on
    assert r.params.num_inference_steps == pipe.gen_config.diff_infer_steps and r.params.flow_shift == 3.0
    assert res.spec.template == "instruct" and res.bot_task == "image" and res.mode == "t2i"
    one = pipe.preprocess(request(guidance_scale=1.0)).plan
    assert one.cfg_factor == 1
    assert pipe.preprocess(r) is r  # preprocess runs once


def test_the_plan_is_typed_and_the_callers_extra_is_left_as_sent(pipe, paged_pipe):
    from omni_hunyuan.pipeline import Resolved

    sent = {"guidance_rescale": 0.25}
    for p in (pipe, paged_pipe):
        r = p.preprocess(request(extra=sent))
        assert r.extra == sent and r.plan_as(Resolved).guidance_rescale == 0.25  # no "hunyuan"/"prepared_layout"
    with pytest.raises(ValueError, match="not a Resolved"):
        request().plan_as(Resolved)


@pytest.mark.parametrize("kwargs,field", [
    ({"negative_prompt": "blurry"}, "negative_prompt"),
    ({"extra": {"mode": "edit"}}, "inputs"),
    ({"height": 64, "width": 1024}, "params.height"),
    ({"extra": {"bot_task": "draw"}}, "extra.bot_task"),
    ({"extra": {"guidance_rescale": 2.0}}, "extra.guidance_rescale"),
    ({"num_outputs": 2}, "params.num_outputs"),
    ({"extra": {"sequence_template": "chat"}}, "extra.sequence_template"),
])
def test_bad_inputs_give_one_clear_error(pipe, kwargs, field):
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(request(**kwargs))
    assert info.value.field == field


def test_edit_resolution_defaults_to_the_image(pipe):
    r = pipe.preprocess(request("make it blue", images=(square_image(80),), height=None, width=None))
    res = r.plan
    assert res.mode == "edit" and (r.params.height, r.params.width) == (64, 64)
    (cond,) = res.spec.cond_images
    assert (cond.vae_h, cond.vae_w) == (4, 4) and cond.vit_h * cond.vit_w <= 16
    assert res.identity  # edits carry the reference content + VAE seed identity


@pytest.mark.slow
def test_generation_is_deterministic_and_seed_dependent(pipe):
    _, (a,) = run(pipe, request(seed=3, num_inference_steps=2))
    _, (b,) = run(pipe, request(seed=3, num_inference_steps=2))
    _, (c,) = run(pipe, request(seed=4, num_inference_steps=2))
    assert a.frames.shape == (1, 64, 64, 3) and a.frames.dtype == np.uint8 and a.seed == 3
    assert np.array_equal(a.frames, b.frames) and not np.array_equal(a.frames, c.frames)


@pytest.mark.slow
def test_edit_end_to_end_depends_on_the_image(pipe):
    s1, (a,) = run(pipe, request("make it blue", images=(square_image(seed=1),), num_inference_steps=2))
    s2, _ = run(pipe, request("make it blue", images=(square_image(seed=2),), num_inference_steps=2), decode=False)
    assert a.frames.shape == (1, 64, 64, 3)
    assert not torch.equal(s1.latents, s2.latents)


def test_guidance_rescale_changes_the_result(pipe):
    plain, _ = run(pipe, request(num_inference_steps=2), decode=False)
    rescaled, _ = run(pipe, request(num_inference_steps=2, extra={"guidance_rescale": 0.7}), decode=False)
    assert not torch.allclose(plain.latents, rescaled.latents)


def test_kv_reuse_off_recomputes_and_agrees(micro_dir, pipe):
    from _hunyuan_helpers import load

    off = load(micro_dir, kv_reuse=False)
    a, _ = run(pipe, request(num_inference_steps=3), decode=False)
    b, _ = run(off, request(num_inference_steps=3), decode=False)
    assert b.extras["items"][0]["past"] is None
    assert torch.allclose(a.latents, b.latents, atol=1e-4)


def test_guidance_and_sampler_math():
    from omni_hunyuan.sampler import euler_step, guide, model_timesteps, sigmas

    grid = sigmas(3, 3.0)
    t = torch.linspace(1, 0, 4, dtype=torch.float64)
    assert torch.allclose(grid, 3 * t / (1 + 2 * t)) and grid[0] == 1.0 and grid[-1] == 0.0
    assert torch.allclose(model_timesteps(grid), grid[:-1] * 1000)
    x, v = torch.ones(2), torch.full((2,), 2.0)
    assert torch.allclose(euler_step(x, v, 0.8, 0.5), torch.full((2,), 0.4))
    c, u = torch.randn(1, 4, 2, 2), torch.randn(1, 4, 2, 2)
    assert torch.allclose(guide(c, u, 3.0), u + 3.0 * (c - u))
    full = guide(c, u, 3.0, rescale=1.0)
    assert torch.allclose(full.std(), c.std(), atol=1e-5)


def test_select_requests_keeps_survivors(pipe):
    reqs = [pipe.preprocess(request(seed=s, num_inference_steps=2)) for s in (1, 2)]
    state = pipe.encode(reqs)
    state = pipe.denoise_step(state, 0)
    second = state.latents[1].clone()
    state = pipe.select_requests(state, [1])
    assert [r.params.seed for r in state.requests] == [2] and torch.equal(state.latents[0], second)
    state = pipe.denoise_step(state, 1)
    solo = pipe.encode([reqs[1]])
    for step in range(2):
        solo = pipe.denoise_step(solo, step)
    assert torch.allclose(state.latents, solo.latents, atol=1e-5)


def test_vae_decode_precision_is_honoured(pipe):
    from omni_hunyuan.pipeline import HunyuanImage3Pipeline
    from omnicore.engine.protocol import DenoiseState

    low = HunyuanImage3Pipeline(pipe.model, pipe.tokenizer, pipe.gen_config, device=pipe.device, dtype=pipe.dtype,
                                vae_decode_precision="bf16")
    assert low.vae_decode_dtype is torch.bfloat16 and pipe.vae_decode_dtype is None
    req = pipe.preprocess(request())

    def decode(p):
        lat = torch.randn(1, 4, 2, 2, generator=torch.Generator().manual_seed(0)) * 3
        state = DenoiseState(requests=[req], num_steps=1, latents=lat,
                             extras={"items": [{"request": req, "pool_hit_tokens": 0}]})
        return p.decode(state)[0].frames.astype(int)

    full, half = decode(pipe), decode(low)
    assert full.shape == half.shape == (1, 32, 32, 3)
    assert (full != half).any() and abs(full - half).max() <= 32


@pytest.mark.slow
def test_cfg_distilled_checkpoint_uses_the_guidance_token(tmp_path):
    """A CFG-distilled checkpoint runs one row whatever the guidance, and the scale reaches the model through the
    <guidance> token's embedding."""
    from _hunyuan_helpers import load
    from omni_hunyuan.presets import build_tiny

    distilled = load(build_tiny(tmp_path / "distilled", base_size=64, overrides={"cfg_distilled": True}))
    assert hasattr(distilled.model, "guidance_emb")
    preds = {}
    for g in (2.0, 6.0):
        req = distilled.preprocess(request(guidance_scale=g, num_inference_steps=2))
        res = req.plan
        assert res.cfg_factor == 1 and res.spec.guidance_token
        state = distilled.encode([req])
        layout = state.extras["items"][0]["layout"]
        assert layout.rows == 1 and layout.tokens[0][layout.guidance_pos] == distilled.tokenizer.ids["guidance"]
        preds[g] = distilled.predict(state, 0)
    assert not torch.allclose(preds[2.0], preds[6.0])


def test_prompt_mapping_fields_fall_back_behind_extra(pipe):
    """A prompt mapping carries prompt fields; the request's extra wins (think_recaption -> think)."""
    from omnicore.engine.request import GenerationRequest, SamplingParams

    params = SamplingParams(height=64, width=64, num_inference_steps=2, seed=1)
    prompt = {"prompt": "a red fox", "bot_task": "vanilla", "use_system_prompt": "en_unified"}
    res = pipe.preprocess(GenerationRequest(prompt, params, extra={"bot_task": "think_recaption"})).plan
    assert res.bot_task == "think" and res.spec.prompt == "a red fox"
    assert res.spec.system_prompt is not None and "multimodal" in res.spec.system_prompt
    res2 = pipe.preprocess(GenerationRequest(prompt, params)).plan
    assert res2.bot_task == "image"
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(GenerationRequest({"text": "x"}, params))
    assert info.value.field == "prompt.prompt"
