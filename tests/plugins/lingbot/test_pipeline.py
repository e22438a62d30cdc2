"""LingBot pipeline on the tiny preset: modes, CFG variants, TI2V prefix, batching, determinism."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from _lingbot_helpers import request, run
from omni_lingbot.pipeline import pad_embeddings
from omni_lingbot.plan import LingBotPlan, plan_of
from omni_lingbot.prompts import DEFAULT_NEGATIVE_PROMPT_IMAGE, DEFAULT_NEGATIVE_PROMPT_VIDEO
from omnicore.errors import InvalidRequest
from PIL import Image


class Recorder:
    """Stands between the pipeline and its DiT, keeping a copy of every input it sees."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.inputs: list[torch.Tensor] = []
        self.batch_sizes: list[int] = []

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        self.inputs.append(kwargs["hidden_states"].detach().clone())
        self.batch_sizes.append(kwargs["hidden_states"].shape[0])
        return self.model(**kwargs)


@pytest.fixture
def recorder(pipe: Any) -> Any:
    original = pipe.transformer
    pipe.transformer = rec = Recorder(original)
    try:
        yield rec
    finally:
        pipe.transformer = original


def _image() -> Image.Image:
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, (24, 40, 3), dtype=np.uint8))  # 40 wide x 24 tall


# ---------------------------------------------------------------------------------------------- outputs


def test_text_to_image_returns_one_image_frame(pipe):
    _, outputs = run(pipe, request(modalities=("image",), height=32, width=48))
    (out,) = outputs
    assert out.kind == "image" and out.fps is None
    assert out.frames.shape == (1, 32, 48, 3) and out.frames.dtype == np.uint8
    assert out.seed == 7


def test_text_to_video_shape_and_fps(pipe):
    state, outputs = run(pipe, request(num_frames=6, fps=12.0))  # 6 rounds up to 9 frames -> 3 latent frames
    assert state.latents.shape == (1, 4, 3, 4, 4)
    (out,) = outputs
    assert out.kind == "video" and out.fps == 12.0 and out.frames.shape == (9, 32, 32, 3)


def test_preprocess_normalises_once(pipe):
    raw = request({"caption": "a fox", "duration": 1}, num_frames=None, negative_prompt=None, fps=8.0)
    prepared = pipe.preprocess(raw)
    assert prepared.prepared and prepared.prompt == "a fox"
    assert prepared.params.num_frames == 9  # 1 s x 8 fps -> 8 -> 9
    assert prepared.negative_prompt == DEFAULT_NEGATIVE_PROMPT_VIDEO
    assert prepared.modalities == ("video",) and plan_of(prepared).mode == "t2v"
    assert prepared.extra == raw.extra and isinstance(prepared.plan, LingBotPlan)  # the caller's extra untouched
    assert pipe.preprocess(prepared) is prepared  # admission happens once
    t2i = pipe.preprocess(request(modalities=("image",)))
    assert t2i.negative_prompt == DEFAULT_NEGATIVE_PROMPT_IMAGE and t2i.params.num_frames == 1
    assert pipe.preprocess(request(negative_prompt="")).negative_prompt == ""


def test_preprocess_rejects_with_named_fields(pipe, tmp_path):
    with pytest.raises(InvalidRequest, match="does not accept") as info:
        pipe.preprocess(request(modalities=("image",), images=[_image()]))
    assert info.value.field == "images"
    with pytest.raises(InvalidRequest, match="one output per prompt"):
        pipe.preprocess(request(num_outputs=2))
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(request(images=[str(tmp_path / "missing.png")]))
    assert info.value.field == "images[0]"


def test_preprocess_loads_image_paths(pipe, tmp_path):
    path = tmp_path / "ref.png"
    Image.new("L", (48, 32), 90).save(path)
    prepared = pipe.preprocess(request(images=[str(path)]))
    (img,) = prepared.images
    assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (48, 32)
    assert plan_of(prepared).mode == "ti2v"


# ---------------------------------------------------------------------------------------------- CFG


@pytest.mark.parametrize(("guidance", "batch_cfg", "calls_per_step", "batch"), [
    (1.0, False, 1, 1), (2.0, False, 2, 1), (2.0, True, 1, 2),
])
def test_forward_count_per_cfg_mode(pipe, recorder, guidance, batch_cfg, calls_per_step, batch):
    state, _ = run(pipe, request(guidance_scale=guidance, extra={"batch_cfg": batch_cfg}))
    assert len(recorder.inputs) == calls_per_step * state.num_steps
    assert set(recorder.batch_sizes) == {batch}


def test_batch_cfg_auto_runs_two_passes_on_cpu_and_says_so(pipe, recorder, monkeypatch):
    # no batch_cfg (= "auto") on a CPU pipeline: two B=1 forwards per step (packed measured slower on CPU),
    # visible in the plan and the output metrics; "auto" spelled out is the same choice
    for extra in ({}, {"batch_cfg": "auto"}):
        recorder.inputs.clear()
        recorder.batch_sizes.clear()
        prepared = pipe.preprocess(request(extra=extra))
        assert (plan_of(prepared).batch_cfg, plan_of(prepared).batch_cfg_source) == (False, "auto")
        state, (out,) = run(pipe, request(extra=extra))
        assert len(recorder.inputs) == 2 * state.num_steps and set(recorder.batch_sizes) == {1}
        assert (out.metrics["batch_cfg"], out.metrics["batch_cfg_auto"]) == (0.0, 1.0)
    state, (out,) = run(pipe, request(extra={"batch_cfg": True}))  # an explicit choice is kept and reported
    assert (out.metrics["batch_cfg"], out.metrics["batch_cfg_auto"]) == (1.0, 0.0)
    monkeypatch.setattr(pipe, "parallel", SimpleNamespace(cfg=2))  # CFG ranks run one branch each: not packed
    assert pipe.decode(state)[0].metrics["batch_cfg"] == 0.0


@pytest.mark.parametrize(("device", "extra", "packed", "source"), [
    ("cuda", {}, True, "auto"), ("npu", {"batch_cfg": "auto"}, True, "auto"), ("cpu", {}, False, "auto"),
    ("cuda", {"batch_cfg": False}, False, "request"), ("cpu", {"batch_cfg": True}, True, "request"),
])
def test_batch_cfg_auto_follows_the_pipeline_device(pipe, monkeypatch, device, extra, packed, source):
    # preprocess reads only the device's type (CUDA/NPU execution itself is unverified on this CPU host; without
    # torch_npu, torch.device("npu") does not parse, hence a stand-in carrying only the type)
    monkeypatch.setattr(pipe, "device", SimpleNamespace(type=device))
    plan = plan_of(pipe.preprocess(request(extra=extra)))
    assert (plan.batch_cfg, plan.batch_cfg_source) == (packed, source)


def test_batched_cfg_equals_sequential_cfg(pipe):
    sequential, _ = run(pipe, request(num_inference_steps=4, guidance_scale=3.0))
    batched, _ = run(pipe, request(num_inference_steps=4, guidance_scale=3.0, extra={"batch_cfg": True}))
    torch.testing.assert_close(batched.latents, sequential.latents, atol=2e-5, rtol=1e-5)
    no_cfg, _ = run(pipe, request(num_inference_steps=4, guidance_scale=1.0))
    assert not torch.allclose(no_cfg.latents, sequential.latents, atol=1e-3)  # guidance really acts


def test_batched_cfg_pads_right_and_stacks_positive_first():
    pos, neg = torch.randn(7, 5), torch.randn(9, 5)
    embeds, mask = pad_embeddings([pos, neg])
    assert embeds.shape == (2, 9, 5)
    assert mask[0].tolist() == [True] * 7 + [False] * 2 and bool(mask[1].all())
    torch.testing.assert_close(embeds[0, :7], pos)
    assert float(embeds[0, 7:].abs().sum()) == 0.0
    torch.testing.assert_close(embeds[1], neg)


def test_null_cond_clone_zero_uses_zero_negative(pipe):
    prepared = pipe.preprocess(request(extra={"null_cond_clone_zero": True}))
    state = pipe.encode([prepared])
    cond, cond_mask = state.extras["cond"]
    uncond, uncond_mask = state.extras["uncond"]
    assert uncond.shape == cond.shape and float(uncond.abs().sum()) == 0.0
    assert torch.equal(uncond_mask, cond_mask)
    default = pipe.encode([pipe.preprocess(request())]).extras["uncond"][0]
    assert float(default.abs().sum()) > 0


# ---------------------------------------------------------------------------------------------- TI2V


@pytest.mark.parametrize(("guidance", "batch_cfg"), [(1.0, False), (2.0, False), (2.0, True)])
def test_ti2v_clean_prefix_at_every_call_and_at_the_end(pipe, recorder, guidance, batch_cfg):
    state, outputs = run(pipe, request(images=[_image()], num_frames=9, guidance_scale=guidance,
                                       extra={"batch_cfg": batch_cfg}))
    clean = state.extras["clean"]
    assert clean.shape == (1, 4, 1, 4, 4)
    assert recorder.inputs, "the DiT was never called"
    for seen in recorder.inputs:
        for row in seen.split(1):  # batch CFG stacks [cond; uncond]: both halves carry the prefix
            torch.testing.assert_close(row[:, :, :1], clean, atol=0, rtol=0)
        assert not torch.equal(seen[:, :, 1:], clean.expand_as(seen[:, :, 1:]))
    torch.testing.assert_close(state.latents[:, :, :1], clean, atol=0, rtol=0)
    assert outputs[0].frames.shape == (9, 32, 32, 3)


def test_ti2v_clean_latent_is_the_aligned_image_through_the_vae(pipe):
    from omni_lingbot.conditions import align_image

    prepared = pipe.preprocess(request(images=[_image()], num_frames=9))
    state = pipe.encode([prepared])
    gen = torch.Generator().manual_seed(prepared.params.seed)
    expected = pipe.vae.encode(align_image(prepared.images[0], 32, 32), gen)
    torch.testing.assert_close(state.extras["clean"], expected, atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- batching


def test_batch_of_requests_equals_each_alone(pipe):
    a = request("a red fox", seed=1)
    b = request({"scene": "a snowy forest", "mood": "calm"}, seed=2)
    both, outs = run(pipe, a, b)
    alone_a, out_a = run(pipe, a)
    alone_b, out_b = run(pipe, b)
    torch.testing.assert_close(both.latents[:1], alone_a.latents, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(both.latents[1:], alone_b.latents, atol=2e-5, rtol=1e-5)
    assert [o.seed for o in outs] == [1, 2]
    assert [o.request_id for o in outs] == [both.requests[0].request_id, both.requests[1].request_id]


def test_batch_key_separates_incompatible_requests(pipe):
    key = pipe.batch_key
    base = pipe.preprocess(request())
    assert key(base) == key(pipe.preprocess(request("another prompt", seed=99)))
    assert key(base) != key(pipe.preprocess(request(extra={"batch_cfg": True})))
    assert key(base) != key(pipe.preprocess(request(height=48)))
    assert key(base) != key(pipe.preprocess(request(images=[_image()])))


def test_select_requests_keeps_survivors_on_track(pipe):
    a, b = request("a red fox", seed=1), request("a blue bird", seed=2)
    state = pipe.encode([pipe.preprocess(a), pipe.preprocess(b)])
    state = pipe.denoise_step(state, 0)
    state = pipe.denoise_step(state, 1)
    state = pipe.select_requests(state, [1])
    for step in range(2, state.num_steps):
        state = pipe.denoise_step(state, step)
    alone, _ = run(pipe, b)
    assert len(state.requests) == 1
    torch.testing.assert_close(state.latents, alone.latents, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- determinism


def test_seed_determinism(pipe):
    _, first = run(pipe, request(seed=11))
    _, again = run(pipe, request(seed=11))
    _, other = run(pipe, request(seed=12))
    assert np.array_equal(first[0].frames, again[0].frames)
    assert not np.array_equal(first[0].frames, other[0].frames)


def test_low_noise_schedule_changes_the_step_count(pipe):
    state, _ = run(pipe, request(num_inference_steps=6, extra={"t_thresh": 0.5, "base_sigma_tail_steps": 1}))
    sigmas = state.extras["scheduler"].sigmas
    assert float(sigmas[0]) == pytest.approx(0.5) and float(sigmas[-1]) == 0.0
    assert state.num_steps == len(state.timesteps) == len(sigmas) - 1


def test_moe_preset_generates(tiny_moe_dir):
    from _lingbot_helpers import load

    moe = load(tiny_moe_dir)
    assert moe.transformer.config.num_experts == 4
    _, outputs = run(moe, request(extra={"batch_cfg": True}))
    assert outputs[0].frames.shape == (5, 32, 32, 3)


# ---------------------------------------------------------------------------------------------- caches


@pytest.mark.parametrize("batch_cfg", [False, True])
def test_first_block_cache_on_the_declared_block_loop(tiny_dir, batch_cfg):
    from _lingbot_helpers import load
    from omnicore.cache import FirstBlockCacheConfig, apply_first_block_cache
    from omnicore.plugin_host.host import PluginHost

    req = request(num_inference_steps=5, extra={"batch_cfg": batch_cfg})
    fresh = load(tiny_dir)
    baseline, _ = run(fresh, req)

    def run_through_host(host, pipe):
        state = pipe.encode([pipe.preprocess(req)])
        for step in range(state.num_steps):
            state = host.denoise(pipeline=pipe, state=state, step=step)
        return state

    host = PluginHost(autoload=False)
    handle = apply_first_block_cache(fresh, FirstBlockCacheConfig(host=host, threshold=1e-12))
    never = run_through_host(host, fresh)
    assert handle.stats(never).reused == []
    torch.testing.assert_close(never.latents, baseline.latents, atol=0, rtol=0)

    forced_pipe, forced_host = load(tiny_dir), PluginHost(autoload=False)
    handle = apply_first_block_cache(forced_pipe, FirstBlockCacheConfig(host=forced_host, force_hits={2, 3}))
    forced = run_through_host(forced_host, forced_pipe)
    assert handle.stats(forced).reused == [2, 3]
    assert torch.isfinite(forced.latents).all()
    assert not torch.equal(forced.latents, baseline.latents)
