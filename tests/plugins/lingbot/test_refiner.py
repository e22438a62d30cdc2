"""The MoE package's refiner stage on ``tiny:lingbot-moe``:
request options, output geometry and fps, the schedule against a hand computation, forward counts, RNG,
cancellation inside the refiner stage, loading, and the engine's progress over both stages."""

from __future__ import annotations

import math
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from _lingbot_helpers import load, request, run
from omni_lingbot.loader import CheckpointError, WeightMismatch
from omni_lingbot.plan import plan_of
from omni_lingbot.presets import TINY_MOE, build_transformer
from omni_lingbot.refiner import refiner_seed, resample_indices
from omni_lingbot.sampler import model_timestep
from omni_lingbot.stage_options import RefinerOptions, resolve_refiner
from omnicore.engine.request import MAX_SEED
from omnicore.errors import InvalidRequest
from PIL import Image

SMALL = {"run_refiner": True, "refiner_height": 64, "refiner_width": 96}


@pytest.fixture(scope="module")
def moe(tiny_moe_dir):
    return load(tiny_moe_dir)


class Recorder:
    """Stands in for a DiT: counts calls and keeps (timestep, batch, text, latent frame 0) of each."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        self.calls.append({"t": kwargs["timestep"][0].item(), "batch": kwargs["hidden_states"].shape[0],
                           "text": kwargs["encoder_hidden_states"].detach().clone(),
                           "frame0": kwargs["hidden_states"][:, :, :1].detach().clone(),
                           "shape": tuple(kwargs["hidden_states"].shape)})
        return self.model(**kwargs)


@pytest.fixture
def recorders(moe):
    base, refiner = moe.transformer, moe.refiner
    moe.transformer, moe.refiner = Recorder(base), Recorder(refiner)
    try:
        yield moe.transformer, moe.refiner
    finally:
        moe.transformer, moe.refiner = base, refiner


def _image() -> Image.Image:
    return Image.fromarray(np.random.default_rng(3).integers(0, 256, (24, 40, 3), dtype=np.uint8))


# ---------------------------------------------------------------------------------------------- options


def test_refiner_is_off_by_default_and_has_the_packages_defaults():
    assert resolve_refiner({}, "t2v") is None
    opts = resolve_refiner({"run_refiner": True}, "t2v")
    assert attrs_tuple(opts) == (1088, 1920, 8, 3.0, 3.0, 0.85, 2, 24.0, True)
    assert (opts.output_fps, opts.max_video_frames, opts.batch_cfg, opts.fps) == (None, None, False, 24.0)
    opts = resolve_refiner({"run_refiner": True, "refiner_output_fps": 30, "refiner_max_video_frames": 9.0,
                            "refiner_batch_cfg": True}, "t2v")
    assert (opts.output_fps, opts.max_video_frames, opts.batch_cfg, opts.fps) == (30.0, 9, True, 30.0)
    opts = resolve_refiner({**SMALL, "refiner_height": 1088.0, "refiner_t_thresh": 1, "refiner_guidance_scale": 0,
                            "refiner_sigma_tail_steps": 0, "refiner_null_cond_clone_zero": False}, "ti2v")
    assert (opts.height, opts.t_thresh, opts.guidance_scale, opts.sigma_tail_steps) == (1088, 1.0, 0.0, 0)
    assert not opts.null_cond_clone_zero
    assert resolve_refiner(SMALL, "t2i").width == 96  # a refined image is allowed


def attrs_tuple(opts: RefinerOptions) -> tuple[Any, ...]:
    return (opts.height, opts.width, opts.steps, opts.guidance_scale, opts.shift, opts.t_thresh,
            opts.sigma_tail_steps, opts.sample_fps, opts.null_cond_clone_zero)


@pytest.mark.parametrize(("extra", "field", "gist"), [
    ({"run_refiner": "true"}, "run_refiner", "true or false"),
    ({"run_refiner": True, "refiner_height": 1000}, "refiner_height", "multiple of 16"),
    ({"run_refiner": True, "refiner_width": 0}, "refiner_width", ">= 16"),
    ({"run_refiner": True, "refiner_width": "96"}, "refiner_width", "integer"),
    ({"run_refiner": True, "refiner_steps": 0}, "refiner_steps", ">= 1"),
    ({"run_refiner": True, "refiner_steps": 2.5}, "refiner_steps", "integer"),
    ({"run_refiner": True, "refiner_guidance_scale": -1}, "refiner_guidance_scale", r"\[0, inf\)"),
    ({"run_refiner": True, "refiner_guidance_scale": float("nan")}, "refiner_guidance_scale", "finite"),
    ({"run_refiner": True, "refiner_shift": 0}, "refiner_shift", r"\(0, inf\)"),
    ({"run_refiner": True, "refiner_t_thresh": 0}, "refiner_t_thresh", r"\(0, 1\]"),
    ({"run_refiner": True, "refiner_t_thresh": 1.5}, "refiner_t_thresh", r"\(0, 1\]"),
    ({"run_refiner": True, "refiner_sigma_tail_steps": -1}, "refiner_sigma_tail_steps", ">= 0"),
    ({"run_refiner": True, "refiner_sample_fps": 0}, "refiner_sample_fps", r"\(0, inf\)"),
    ({"run_refiner": True, "refiner_null_cond_clone_zero": 1}, "refiner_null_cond_clone_zero", "true or false"),
    ({"run_refiner": True, "refiner_max_video_frames": 8}, "refiner_max_video_frames", "1 or 4n\\+1"),
    ({"run_refiner": True, "refiner_max_video_frames": 0}, "refiner_max_video_frames", ">= 1"),
    ({"run_refiner": True, "refiner_output_fps": 0}, "refiner_output_fps", r"\(0, inf\)"),
    ({"run_refiner": True, "refiner_batch_cfg": "yes"}, "refiner_batch_cfg", "true or false"),
    ({"refiner_output_fps": 24}, "refiner_output_fps", "need extra.run_refiner=true"),
    ({"refiner_steps": 4}, "refiner_steps", "need extra.run_refiner=true"),  # option without the stage
    ({"run_refiner": False, "refiner_height": 64}, "refiner_height", "need extra.run_refiner=true"),
])
def test_refiner_option_errors_name_the_field(moe, extra, field, gist):
    with pytest.raises(InvalidRequest, match=gist) as info:
        moe.preprocess(request(extra=extra))
    assert info.value.field == f"extra.{field}"


@pytest.mark.parametrize("key", ["refiner_sample_fps", "refiner_output_fps", "refiner_max_video_frames"])
def test_text_to_image_has_no_frame_rate_to_resample(moe, key):
    with pytest.raises(InvalidRequest, match="no frame rate") as info:
        moe.preprocess(request(modalities=("image",), extra={**SMALL, key: 9}))
    assert info.value.field == f"extra.{key}"


def test_a_checkpoint_without_refiner_rejects_run_refiner(pipe):
    assert pipe.refiner is None  # tiny:lingbot ships no refiner/
    with pytest.raises(InvalidRequest, match="no refiner") as info:
        pipe.preprocess(request(extra=SMALL))
    assert info.value.field == "extra.run_refiner"


# ---------------------------------------------------------------------------------------------- outputs


def test_refined_video_has_the_refiner_size_frames_and_fps(moe):
    state, (out,) = run(moe, request(num_frames=17, fps=24.0, extra={**SMALL, "refiner_sample_fps": 12.0}))
    # 17 frames at 24 fps -> int(17 / 24 * 12) = 8 raw -> 4k+1 = 5 frames, 64x96, reported at 12 fps
    assert out.kind == "video" and out.frames.shape == (5, 64, 96, 3) and out.fps == 12.0
    assert state.latents.shape == (1, 4, 2, 8, 12)
    _, (same_fps,) = run(moe, request(num_frames=9, fps=24.0, extra=SMALL))
    assert same_fps.frames.shape == (9, 64, 96, 3) and same_fps.fps == 24.0
    # refiner_output_fps only relabels the clip; refiner_max_video_frames caps it (17 -> 5 frames)
    _, (capped,) = run(moe, request(num_frames=17, fps=24.0, extra={**SMALL, "refiner_max_video_frames": 5,
                                                                     "refiner_output_fps": 30}))
    assert capped.frames.shape == (5, 64, 96, 3) and capped.fps == 30.0


def test_refined_image_is_an_image_of_the_refiner_size(moe):
    _, (out,) = run(moe, request(modalities=("image",), extra=SMALL))
    assert out.kind == "image" and out.fps is None and out.frames.shape == (1, 64, 96, 3)


def test_resample_indices_follow_the_reference_budget():
    assert resample_indices(17, 24.0, 12.0) == [0, 4, 8, 12, 16]
    assert resample_indices(9, 24.0, 24.0) == list(range(9))
    assert resample_indices(9, 24.0, 12.0) == [0]  # int(9 / 24 * 12) = 4 raw frames -> 4k+1 = 1
    assert resample_indices(5, 12.0, 24.0) == list(range(5))  # a slower clip is never upsampled
    assert resample_indices(1, 24.0, 5.0) == [0]
    # 30 frames at 30 fps -> int(30 / 30 * 24) = 24 raw -> 21; positions 0, 1.45, 2.9, 4.35, 5.8 ... truncated
    # (rounding half up would give 0, 1, 3, 4, 6 ...)
    assert resample_indices(30, 30.0, 24.0) == [0, 1, 2, 4, 5, 7, 8, 10, 11, 13, 14, 15, 17, 18, 20, 21, 23, 24,
                                                26, 27, 29]
    # refiner_max_video_frames caps the count: 17 -> 9
    assert resample_indices(17, 24.0, 24.0, max_frames=9) == [0, 2, 4, 6, 8, 10, 12, 14, 16]


def _hand_low_noise(steps: int, shift: float, t: float, tail: int) -> list[float]:
    """ written out with plain floats."""
    sigma_max, sigma_min = float(np.float32(0.999)), 0.0  # the float32 training sigma
    grid = [sigma_max + (sigma_min - sigma_max) * i / steps for i in range(steps)]  # linspace(max, min, N+1)[:-1]
    shifted = [shift * s / (1 + (shift - 1) * s) for s in grid]
    kept = [s for s in shifted if s <= t + 1e-6]
    if not kept or abs(kept[0] - t) > 1e-6:
        kept = [t, *kept]
    last, end = kept[-1], min(sigma_min, kept[-1])
    return kept + [last + (end - last) * k / (tail + 1) for k in range(1, tail + 1)]


@pytest.mark.parametrize(("options", "expected_len"), [
    ({}, 8),  # steps 8, shift 3, t 0.85, tail 2: 5 kept + 0.85 + 2 tail
    ({"refiner_steps": 4, "refiner_t_thresh": 0.5, "refiner_sigma_tail_steps": 0, "refiner_shift": 1.0}, 3),
    # 0.4999 and 0.4995 both truncate to timestep 499: the sampler must still start at index 0
    ({"refiner_steps": 4, "refiner_t_thresh": 0.4999, "refiner_sigma_tail_steps": 0, "refiner_shift": 1.0}, 3),
])
def test_refiner_runs_the_low_noise_schedule(moe, recorders, options, expected_len):
    base, refiner = recorders
    state, _ = run(moe, request(num_inference_steps=2, extra={**SMALL, **options}))
    opts = plan_of(state.requests[0]).refiner
    sigmas = _hand_low_noise(opts.steps, opts.shift, opts.t_thresh, opts.sigma_tail_steps)
    assert len(sigmas) == expected_len and sigmas[0] == opts.t_thresh
    if not options:  # spot values of the default schedule, worked by hand: 3s/(1+2s) at s = 0.624375, 0.124875
        assert sigmas[1] == pytest.approx(0.8329629, abs=1e-6) and sigmas[5] == pytest.approx(0.2997600, abs=1e-6)
        assert sigmas[6:] == pytest.approx([0.19984, 0.09992], abs=1e-5)
    scheduler = state.extras["scheduler"]
    np.testing.assert_allclose(scheduler.sigmas.numpy()[:-1], sigmas, rtol=0, atol=1e-6)
    assert scheduler.sigmas[-1].item() == 0.0
    assert state.num_steps == 2 + len(sigmas)
    # the refiner DiT saw each refiner timestep once per CFG branch: int(sigma*1000), bf16-rounded
    expected_t = [model_timestep(int(s * 1000)).item() for s in sigmas]
    assert [c["t"] for c in refiner.calls[::2]] == expected_t == [c["t"] for c in refiner.calls[1::2]]
    assert len(base.calls) == 2 * 2


@pytest.mark.parametrize(("extra", "calls", "batch"), [
    ({}, 16, 1),  # refiner CFG 3.0, sequential: 2 forwards per refiner step
    ({"refiner_batch_cfg": True}, 8, 2),  # one packed forward per step (the refiner's own switch)
    ({"batch_cfg": True}, 16, 1),  # the base stage's batch_cfg does not switch the refiner's
    ({"refiner_guidance_scale": 1.0}, 8, 1),  # no CFG
])
def test_refiner_forward_count(moe, recorders, extra, calls, batch):
    base, refiner = recorders
    state, _ = run(moe, request(num_inference_steps=3, extra={**SMALL, **extra}))
    assert len(refiner.calls) == calls and {c["batch"] for c in refiner.calls} == {batch}
    assert {c["shape"][-2:] for c in refiner.calls} == {(8, 12)}  # latents of 64x96
    assert len(base.calls) == 3 * (1 if extra.get("batch_cfg") else 2)
    assert {c["batch"] for c in base.calls} == {2 if extra.get("batch_cfg") else 1}
    assert state.num_steps == 3 + 8


def test_refiner_negative_is_zeros_by_default_else_the_negative_prompt(moe, recorders):
    _, refiner = recorders
    run(moe, request(extra=SMALL))
    cond, uncond = refiner.calls[0]["text"], refiner.calls[1]["text"]
    assert cond.abs().sum() > 0 and torch.count_nonzero(uncond) == 0 and uncond.shape == cond.shape
    refiner.calls.clear()
    run(moe, request(negative_prompt="blurry", extra={**SMALL, "refiner_null_cond_clone_zero": False}))
    neg = refiner.calls[1]["text"]
    expected = moe.text_encoder.encode("blurry", None)
    assert torch.equal(neg[0, : expected.shape[0]], expected.to(neg.dtype))


def test_ti2v_refiner_keeps_a_clean_first_frame(moe, recorders):
    _, refiner = recorders
    state, (out,) = run(moe, request(num_frames=9, images=[_image()], extra=SMALL))
    assert out.frames.shape == (9, 64, 96, 3)
    clean = state.extras["clean"]
    assert clean.shape == (1, 4, 1, 8, 12)
    for call in refiner.calls:
        assert torch.equal(call["frame0"][:1].float(), clean)
    assert torch.equal(state.latents[:, :, :1], clean)


# ---------------------------------------------------------------------------------------------- randomness


def test_refiner_seed_is_splitmix64_of_the_base_seed():
    assert refiner_seed(0) == 0xE220A8397B1DCDAF & MAX_SEED  # SplitMix64's published first output for state 0
    assert refiner_seed(MAX_SEED) <= MAX_SEED and refiner_seed(7) != refiner_seed(8)
    assert len({refiner_seed(s) for s in range(1000)}) == 1000


def test_refiner_is_deterministic_per_seed_and_batch_invariant(moe):
    a, b = request(seed=7, extra=SMALL), request(seed=8, extra=SMALL)
    state_a, (first,) = run(moe, a)
    _, (again,) = run(moe, a)
    state_b, (other,) = run(moe, b)
    assert np.array_equal(first.frames, again.frames) and not np.array_equal(first.frames, other.frames)
    # each request draws from its own refiner generator, so batching changes only float rounding (the batched
    # DiT pads text and packs rows; measured 1e-5 on the final latents, one uint8 level on the frames)
    pair_state, pair = run(moe, a, b)
    torch.testing.assert_close(pair_state.latents[:1], state_a.latents, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pair_state.latents[1:], state_b.latents, atol=1e-4, rtol=1e-4)
    assert np.abs(pair[1].frames.astype(int) - other.frames).max() <= 2


def test_cancelling_inside_the_refiner_stage_keeps_the_survivor_exact(moe):
    a, b = request(seed=7, extra=SMALL), request(seed=8, extra=SMALL)
    alone, _ = run(moe, b)
    state = moe.encode([moe.preprocess(a), moe.preprocess(b)])
    for step in range(state.num_steps):
        if step == 5:  # base has 3 steps: two refiner steps done, multistep history non-empty
            assert state.extras["phase"] == "refiner"
            state = moe.select_requests(state, [1])
        state = moe.denoise_step(state, step)
    assert state.latents.shape == alone.latents.shape
    torch.testing.assert_close(state.latents, alone.latents, atol=1e-4, rtol=1e-4)  # batched steps: rounding only


# ---------------------------------------------------------------------------------------------- loading, engine


def test_refiner_loads_strictly(tiny_moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = shutil.copytree(tiny_moe_dir, tmp_path / "bad")
    weights = bad / "refiner" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(weights))
    state.pop("proj_out.weight")
    save_file(state, str(weights))
    with pytest.raises(WeightMismatch, match="proj_out.weight") as info:
        load(bad)
    assert info.value.path == bad / "refiner"
    other = shutil.copytree(tiny_moe_dir, tmp_path / "other")
    shutil.rmtree(other / "refiner")
    build_transformer(other / "refiner", {**TINY_MOE, "text_dim": 16}, seed=1)  # self-consistent, wrong text width
    with pytest.raises(CheckpointError, match="refiner text_dim 16 differs"):
        load(other)


def test_engine_progress_counts_both_stages_and_model_offload_covers_the_refiner(moe, tiny_moe_dir, tmp_path):
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost

    settings = Settings(cache_dir=str(tmp_path / "cache"))
    engine = Engine(tiny_moe_dir, host=PluginHost(settings), settings=settings, offload="model")
    events: list[Any] = []
    try:
        assert "refiner" in engine.pipeline.offload_modules
        prepared = request(extra=SMALL)
        job = engine.submit(prepared, on_event=events.append)
        (out,) = job.result(60)
        assert sum(p.untyped_storage().nbytes() for p in engine.pipeline.refiner.parameters()) == 0
    finally:
        engine.close()
    denoise = [(e.step, e.total_steps) for e in events if e.phase == "denoise"]
    assert denoise == [(i, 11) for i in range(1, 12)]  # 3 base + 8 refiner steps
    assert out.metrics["steps"] == 11
    _, (direct,) = run(moe, request(extra=SMALL))
    assert np.array_equal(out.frames, direct.frames) and math.isclose(out.fps, 24.0)
