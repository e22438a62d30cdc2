"""Pipeline building blocks against diffusers' MiniMax-H3 (the parity reference), bit for bit: packed layouts,
(un)patchify, the two sigma schedules and the Euler step, the Qwen3-VL layer-50 readout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omni_minimax_h3 import packing
from omni_minimax_h3.sampler import euler_step, paired_sigmas, sigmas, timesteps

LAYOUT_FIELDS = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices",
                 "num_condition_video_rows", "num_condition_audio_rows")


def assert_layout_equal(ours: packing.Layout, ref: tuple) -> None:
    for name, expected in zip(LAYOUT_FIELDS, ref):
        got = getattr(ours, name)
        if isinstance(expected, torch.Tensor):
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
        else:
            assert got == expected, name


TAGS = torch.tensor([1] * 6 + [0] * 4 + [1] * 5)


@pytest.mark.parametrize("anchors", [(), ("first",), ("last",), ("first", "last")])
@pytest.mark.parametrize(("frames", "lh", "lw"), [(2, 4, 4), (32, 4, 8), (37, 8, 4)])
def test_keyframe_layout_matches_diffusers(anchors, frames, lh, lw):
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep

    ours = packing.keyframe_layout(TAGS, frames, lh, lw, 178, anchors)
    ref = MiniMaxH3PrepareLayoutStep.build_packed_sequence(TAGS, frames, lh, lw, 178, (1, 2, 2), 2, 2, 0, anchors)
    assert_layout_equal(ours, ref)


def test_reference_layout_matches_diffusers():
    """Images, a standalone audio and videos with and without a soundtrack (≥ 16 latent frames, where the
    sequential and the pairwise span sums differ in the last ulp)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3Ref2VAPrepareLayoutStep

    refs = [("image", (1, 6, 4), 0), ("audio", None, 90), ("video", (17, 4, 8), 120), ("image", (1, 4, 4), 0),
            ("video", (7, 8, 4), 0)]
    condition = [torch.zeros(1, 24, *g) for _, g, _ in refs if g is not None]
    audio = [torch.zeros(2 * n, 32) for _, _, n in refs if n]
    objs = [SimpleNamespace(kind=k, has_audio=n > 0) for k, _, n in refs]
    ref = MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence(TAGS, objs, condition, audio, 32, 4, 8, 178,
                                                                         (1, 2, 2), 2, 2, 0)
    blocks = [packing.ReferenceBlock(k, g, n) for k, g, n in refs]
    assert_layout_equal(packing.reference_layout(TAGS, blocks, 32, 4, 8, 178), ref)
    assert packing.span_sequential(17) != packing.span_pairwise(17)  # the two orders really differ here


def test_patchify_round_trip_matches_diffusers():
    from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

    x = torch.randn(1, 24, 7, 4, 8)
    rows = packing.patchify(x)
    assert torch.equal(rows, patchify_video_latents(x, (1, 2, 2)))
    assert torch.equal(packing.unpatchify(rows, 24, 7, 4, 8), x)
    audio = torch.randn(2 * 5, 32)
    assert torch.equal(packing.audio_rows_to_latents(audio, 5), audio.reshape(2, 5, 32).permute(0, 2, 1))


@pytest.mark.parametrize(("points", "shift"), [(50, 12.0), (50, 3.0), (4, 12.0), (2, 3.0), (17, 7.5)])
def test_sigmas_match_diffusers_scheduler(points, shift):
    from diffusers import MiniMaxH3Scheduler

    ref = MiniMaxH3Scheduler(shift=shift)
    ref.set_timesteps(points)
    assert torch.equal(sigmas(points, shift), ref.sigmas)
    assert torch.equal(timesteps(sigmas(points, shift)), ref.timesteps)


def test_euler_step_matches_diffusers_scheduler():
    from diffusers import MiniMaxH3Scheduler

    ref = MiniMaxH3Scheduler(shift=12.0)
    ref.set_timesteps(5)
    grid = sigmas(5, 12.0)
    ts = timesteps(grid)
    x = torch.randn(10, 96)
    ours = x.clone()
    for k in range(4):
        v = torch.randn(10, 96)
        x = ref.step(v, ref.timesteps[k], x, return_dict=False)[0]
        ours = euler_step(ours, v, ts[k], grid[k], grid[k + 1])
        assert torch.equal(ours, x)


def test_schedules_have_equal_length_or_fail():
    video, audio = paired_sigmas(50, 12.0, 3.0)
    assert video.numel() == audio.numel() == 50 and video[-1] == audio[-1] == 0
    with pytest.raises(ValueError, match="at least 2"):
        sigmas(1, 12.0)


def test_text_encoder_reads_layer_50_pre_norm(pipe, tiny_dir):
    """Our 50-layer conditioner's readout equals transformers' ``hidden_states[50]`` of the full 51-layer
    model (pre-norm), with and without a vision block; tags mark the vision block as video (0)."""
    from _h3_helpers import image
    from transformers import Qwen3VLForConditionalGeneration

    enc = pipe.text_encoder
    assert len(enc.model.language_model.layers) == 50
    full = Qwen3VLForConditionalGeneration.from_pretrained(str(tiny_dir / "text_encoder"), dtype=torch.float32)
    assert full.config.text_config.num_hidden_layers == 51
    for items in ((), (("<Picture 1>: ", image()),)):
        rows, tags = enc.encode("rain on a tin roof", items)
        ids, _ = enc.presentation("rain on a tin roof", [(t, int(n)) for t, n in
                                                         zip([i[0] for i in items], [tags.eq(0).sum() - 2])])
        input_ids = torch.tensor([ids])
        kwargs = {}
        if items:
            proc = enc.image_processor(images=[items[0][1]], return_tensors="pt")
            kwargs = {"pixel_values": proc["pixel_values"], "image_grid_thw": proc["image_grid_thw"]}
        mm = (input_ids == full.config.image_token_id).long()
        out = full.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=mm,
                         use_cache=False, output_hidden_states=True, **kwargs)
        assert torch.equal(rows, out.hidden_states[50][0])
        assert not torch.allclose(rows, out.hidden_states[-1][0])  # the last entry is post-norm
        assert tags.tolist() == [1 if t not in (enc._ids["<|vision_start|>"], enc._ids["<|vision_end|>"],
                                                 enc._ids["<|image_pad|>"]) else 0 for t in ids]
