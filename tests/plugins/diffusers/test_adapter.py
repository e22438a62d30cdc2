"""The generic diffusers adapter against diffusers itself: the same checkpoint, the same generator, the same bytes.

Every comparison calls the stock pipeline directly (``DiffusionPipeline.from_pretrained`` on the directory the
engine loaded) with ``torch.Generator().manual_seed(seed)`` and compares the uint8 pixels exactly (CPU).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

PROMPT = "a red fox in the snow"
TINY = {"height": 32, "width": 32}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pixels(images: Any) -> np.ndarray:
    return np.stack([np.asarray(i) for i in images])


def _picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))


# ------------------------------------------------------------------ the card comes from the signature
@pytest.mark.parametrize(("name", "modes", "roles", "outputs", "routed"), [
    ("flux", ("t2i",), (), ("image",), True),
    ("flux-img2img", ("i2i",), ("reference",), ("image",), True),
    ("flux-inpaint", ("inpaint",), ("edit_source", "mask"), ("image",), True),
    ("sd3", ("t2i",), (), ("image",), False),  # JointAttnProcessor2_0 calls SDPA itself
    ("wan", ("t2v",), (), ("video",), True),
])
def test_modes_roles_and_outputs_come_from_the_pipeline(engines: Any, name: str, modes: tuple, roles: tuple,
                                                        outputs: tuple, routed: bool) -> None:
    caps = engines[name].spec.capabilities
    assert caps.modes == modes and caps.outputs == outputs
    assert tuple(r.role for r in caps.input_roles()) == roles
    assert caps.honours_attention_backend is routed  # omni_diffusers.attention, per loaded pipeline


def test_the_card_lists_limits_and_extra_keywords(engines: Any) -> None:
    wan, flux = engines["wan"], engines["flux"]
    assert wan.spec.capabilities.frame_rule == "4n+1" and wan.spec.capabilities.size_multiple_of == 16
    assert flux.spec.capabilities.size_multiple_of == 2 and flux.spec.capabilities.max_frames == 1  # vae factor 1
    assert "FluxPipeline" in flux.spec.description
    keys = flux.pipeline.card.extra_keys
    assert "max_sequence_length" in keys and "true_cfg_scale" in keys
    assert "prompt_embeds" not in keys and "generator" not in keys and "callback_on_step_end" not in keys
    fields = {f.name: (f.type, f.default) for f in flux.spec.request_fields}  # /v1/models' model_params
    assert fields["max_sequence_length"] == ("int", 512) and fields["true_cfg_scale"] == ("float", 1.0)


# ------------------------------------------------------------------ bit for bit equal to the stock pipeline
def test_flux_equals_the_stock_pipeline(engines: Any, direct: Any) -> None:
    engine = engines["flux"]
    [out] = engine.generate(PROMPT, seed=7, num_inference_steps=3, **TINY)
    ref = direct(engine)(PROMPT, num_inference_steps=3, guidance_scale=3.5, max_sequence_length=32,
                         generator=_gen(7), **TINY).images
    assert out.kind == "image" and np.array_equal(out.frames, _pixels(ref))
    assert len(out.metrics["step_times_s"]) == 3 and out.metrics["diffusers_pipeline"] == "FluxPipeline"


def test_sd3_with_guidance_and_a_negative_prompt_equals_the_stock_pipeline(engines: Any, direct: Any) -> None:
    engine = engines["sd3"]
    [out] = engine.generate(PROMPT, seed=6, negative_prompt="blurry", **TINY)
    ref = direct(engine)(PROMPT, negative_prompt="blurry", num_inference_steps=2, guidance_scale=7.0,
                         max_sequence_length=32, generator=_gen(6), **TINY).images
    assert np.array_equal(out.frames, _pixels(ref))


def test_wan_video_equals_the_stock_pipeline(engines: Any, direct: Any) -> None:
    engine = engines["wan"]
    [out] = engine.generate(PROMPT, seed=5, num_frames=5, negative_prompt="blurry", **TINY)
    ref = direct(engine)(PROMPT, negative_prompt="blurry", num_frames=5, num_inference_steps=2, guidance_scale=5.0,
                         max_sequence_length=32, generator=_gen(5), output_type="np", **TINY).frames
    assert out.kind == "video" and out.fps == engine.spec.defaults.fps and out.frames.shape == (5, 32, 32, 3)
    assert np.array_equal(out.frames, (ref[0] * 255).round().astype("uint8"))


def test_img2img_reference_and_strength_equal_the_stock_pipeline(engines: Any, direct: Any) -> None:
    """``image`` fills the ``reference`` role; ``strength`` passes through ``extra`` and shortens the loop, and
    progress counts the steps diffusers really runs (4 steps at strength 0.5 are 2)."""
    engine, source = engines["flux-img2img"], _picture(1)
    events: list[Any] = []
    from omnicore.engine.api import make_request

    job = engine.submit(make_request(PROMPT, images=[source], seed=3, extra={"strength": 0.5}, **TINY),
                        on_event=events.append)
    [out] = job.result(120)
    ref = direct(engine)(PROMPT, image=source, strength=0.5, num_inference_steps=4, guidance_scale=3.5,
                         max_sequence_length=32, generator=_gen(3), **TINY).images
    assert np.array_equal(out.frames, _pixels(ref))
    assert [e.step for e in events if e.phase == "denoise"] == [1, 2] and out.metrics["steps"] == 2


def test_inpaint_edit_source_and_mask_equal_the_stock_pipeline(engines: Any, direct: Any) -> None:
    from omnicore.plugin import MediaInput

    engine, source = engines["flux-inpaint"], _picture(2)
    mask = Image.fromarray(np.where(np.arange(32)[None, :, None] < 16, 255, 0).repeat(32, 0).repeat(3, 2)
                           .astype(np.uint8))
    [out] = engine.generate(PROMPT, inputs=[MediaInput("image", "edit_source", source),
                                            MediaInput("image", "mask", mask)], seed=4, **TINY)
    ref = direct(engine)(PROMPT, image=source, mask_image=mask, num_inference_steps=4, guidance_scale=3.5,
                         max_sequence_length=32, generator=_gen(4), **TINY).images
    assert np.array_equal(out.frames, _pixels(ref))
    with pytest.raises(Exception) as info:  # a mask alone is refused before anything runs
        engine.generate(PROMPT, inputs=[MediaInput("image", "mask", mask)], seed=4, **TINY)
    assert getattr(info.value, "field", None) == "inputs"


# ------------------------------------------------------------------ batching: one call, one generator per row
def test_a_batch_is_one_call_whose_rows_equal_solo_runs(engines: Any, direct: Any) -> None:
    """Two requests (one with two outputs) encoded together: one diffusers call with three prompts and three
    generators; every row equals its request run alone, and equals diffusers' own batched call."""
    from omnicore.engine.api import make_request

    engine = engines["flux"]
    pipeline = engine.pipeline
    reqs = [pipeline.preprocess(make_request(p, seed=s, num_outputs=n, **TINY))
            for p, s, n in ((PROMPT, 11, 2), ("a blue cube", 20, 1))]
    calls: list[int] = []
    decode = pipeline.pipe.vae.decode

    def counting_decode(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[0].shape[0])
        return decode(*args, **kwargs)

    pipeline.pipe.vae.decode = counting_decode
    try:
        state = pipeline.encode(reqs)
        for step in range(state.num_steps):
            state = pipeline.denoise_step(state, step)
        batched = pipeline.decode(state)
    finally:
        del pipeline.pipe.vae.decode
    assert calls == [3], calls  # one VAE decode of three rows: one pipeline call
    solo = [o for r in reqs for o in engine.generate(r.prompt, seed=r.params.seed, num_outputs=r.params.num_outputs,
                                                     **TINY)]
    for b, s in zip(batched, solo, strict=True):
        assert np.array_equal(b.frames, s.frames)
    ref = direct(engine)([PROMPT, PROMPT, "a blue cube"], num_inference_steps=2, guidance_scale=3.5,
                         max_sequence_length=32, generator=[_gen(11), _gen(12), _gen(20)], **TINY).images
    assert np.array_equal(np.concatenate([b.frames for b in batched]), _pixels(ref))


def test_img2img_requests_with_different_images_share_a_call_row_by_row(engines: Any) -> None:
    """FluxImg2ImgPipeline reads an image list as one image per prompt, so two requests with different
    references run as one call, each row within one level of its solo run: diffusers' own two-prompt call differs
    from its one-prompt call by ~4e-7 in the transformer's output (CPU matrix products reduce differently for more
    rows), and one pixel here sits on a rounding boundary; the batch equals diffusers' batched call bit for bit
    (test_each_preset)."""
    from omnicore.engine.api import make_request

    engine = engines["flux-img2img"]
    pipeline = engine.pipeline
    reqs = [pipeline.preprocess(make_request(PROMPT, images=[_picture(10 + i)], seed=i, **TINY)) for i in range(2)]
    assert pipeline.batch_key(reqs[0]) == pipeline.batch_key(reqs[1])
    state = pipeline.encode(reqs)
    for step in range(state.num_steps):
        state = pipeline.denoise_step(state, step)
    batched = pipeline.decode(state)
    for i, row in enumerate(batched):
        [solo] = engine.generate(PROMPT, images=[_picture(10 + i)], seed=i, **TINY)
        assert int(np.abs(row.frames.astype(int) - solo.frames.astype(int)).max()) <= 1
    assert not np.array_equal(batched[0].frames, batched[1].frames)


def test_batch_keys_separate_what_cannot_share_a_call(engines: Any) -> None:
    from omnicore.engine.api import make_request

    pipeline = engines["flux"].pipeline
    key = lambda **kw: pipeline.batch_key(pipeline.preprocess(make_request(PROMPT, **{"seed": 1, **TINY, **kw})))  # noqa: E731
    assert key() == key(seed=9)
    assert key() != key(extra={"true_cfg_scale": 2.0}) and key() != key(negative_prompt="blurry")
    assert key() != key(num_inference_steps=3)


# ------------------------------------------------------------------ cancellation and progress
def test_cancel_stops_inside_the_pipeline_call_within_one_step(engines: Any) -> None:
    """Cancelled after step 1 of 6: the transformer runs at most one more step, the VAE never decodes, and the
    next request is served normally (the parked call was left by raising out of it)."""
    from omnicore.engine.api import make_request

    engine = engines["flux"]
    pipe = engine.pipeline.pipe
    forwards: list[int] = []
    decodes: list[int] = []
    hooks = [pipe.transformer.register_forward_pre_hook(lambda m, a: forwards.append(1)),
             pipe.vae.register_forward_pre_hook(lambda m, a: decodes.append(1))]
    decode = pipe.vae.decode
    pipe.vae.decode = lambda *a, **k: (decodes.append(1), decode(*a, **k))[1]
    jobs: list[Any] = []
    ready = threading.Event()

    def on_event(event: Any) -> None:
        if event.phase == "denoise" and event.step == 1:
            ready.wait(30)
            jobs[0].cancel()

    try:
        jobs.append(engine.submit(make_request(PROMPT, seed=1, num_inference_steps=6, **TINY), on_event=on_event))
        ready.set()
        jobs[0].wait(120)
    finally:
        for h in hooks:
            h.remove()
        del pipe.vae.decode
    assert jobs[0].status == "cancelled"
    assert 1 <= len(forwards) <= 2, f"{len(forwards)} transformer forwards after a cancel at step 1"
    assert not decodes, "a cancelled call still decoded"
    active = engine.pipeline._active  # the dropped batch state aborts its parked call: the thread ends
    deadline = time.monotonic() + 30
    while active is not None and active._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active is None or not active._thread.is_alive(), "the cancelled call's thread is still parked"
    [out] = engine.generate(PROMPT, seed=1, **TINY)
    assert out.frames.shape == (1, 32, 32, 3)


def test_progress_is_once_per_step_and_monotone(engines: Any) -> None:
    from omnicore.engine.api import make_request

    events: list[Any] = []
    engines["flux"].submit(make_request(PROMPT, seed=2, num_inference_steps=5, **TINY),
                           on_event=events.append).result(120)
    steps = [(e.step, e.total_steps) for e in events if e.phase == "denoise"]
    assert steps == [(i, 5) for i in range(1, 6)]
    fractions = [e.progress for e in events]
    assert fractions == sorted(fractions)


# ------------------------------------------------------------------ validation
def test_unknown_extra_keywords_are_refused_naming_them(engines: Any) -> None:
    from omnicore.plugin import InvalidRequest

    engine = engines["flux"]
    with pytest.raises(InvalidRequest) as info:
        engine.generate(PROMPT, seed=1, extra={"bogus": 1, "strength": 0.3}, **TINY)  # no strength in t2i FLUX
    assert info.value.field == "extra.bogus" and "bogus, strength" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        engine.generate(PROMPT, seed=1, extra={"prompt_embeds": 1}, **TINY)  # tensors cannot come from a request
    assert info.value.field == "extra.prompt_embeds"
    with pytest.raises(InvalidRequest) as info:
        engine.generate(PROMPT, seed=1, flow_shift=3.0, **TINY)
    assert info.value.field == "params.flow_shift"
    for bad in (float("nan"), -1.0):
        with pytest.raises(InvalidRequest) as info:
            engine.generate(PROMPT, seed=1, guidance_scale=bad, **TINY)
        assert info.value.field == "params.guidance_scale"
    assert engine.generate(PROMPT, seed=1, guidance_scale=0.0, **TINY)  # no guidance is a valid request


def test_a_passed_through_keyword_reaches_the_pipeline(engines: Any, direct: Any) -> None:
    engine = engines["flux"]
    [out] = engine.generate(PROMPT, seed=8, negative_prompt="dark", extra={"true_cfg_scale": 2.0}, **TINY)
    ref = direct(engine)(PROMPT, negative_prompt="dark", true_cfg_scale=2.0, num_inference_steps=2,
                         guidance_scale=3.5, max_sequence_length=32, generator=_gen(8), **TINY).images
    plain = direct(engine)(PROMPT, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=32,
                           generator=_gen(8), **TINY).images
    assert np.array_equal(out.frames, _pixels(ref)) and not np.array_equal(out.frames, _pixels(plain))


def test_wan_frame_rule_is_checked(engines: Any) -> None:
    from omnicore.plugin import InvalidRequest

    with pytest.raises(InvalidRequest) as info:
        engines["wan"].generate(PROMPT, seed=1, num_frames=6, **TINY)
    assert info.value.field == "params.num_frames" and "4n+1" in str(info.value)
