"""MiniMax-H3 request rules: pure functions, no model."""

from __future__ import annotations

import pytest
from omni_minimax_h3.plugin import MODEL_SPEC
from omni_minimax_h3.request_rules import (
    Deployment,
    MediaSummary,
    align_frames,
    audio_latents,
    canvas_for_ratio,
    latent_frames,
    resolve_request,
)
from omnicore.engine.inputs import check_extra
from omnicore.engine.request import SamplingParams
from omnicore.errors import InvalidRequest

FL2VA = Deployment(partitions=("fl2va",))
REF2VA = Deployment(partitions=("ref2va",))
BOTH = Deployment(partitions=("fl2va", "ref2va"))


def resolve(prompt="rain", *, media=(), extra=None, deployment=FL2VA, **params):
    extra = {"aspect_ratio": "16:9"} if extra is None else extra
    return resolve_request(prompt=prompt, negative_prompt=params.pop("negative_prompt", None),
                           params=SamplingParams(**params), extra=extra, media=tuple(media), deployment=deployment)


def img(role, w=512, h=288):
    return MediaSummary("image", role, size=(w, h))


def field_of(fn, *args, **kwargs):
    with pytest.raises(InvalidRequest) as info:
        fn(*args, **kwargs)
    return info.value.field


# ---------------------------------------------------------------------------------------------- frames


@pytest.mark.parametrize(("n", "aligned"), [(29, 39), (96, 107), (107, 107), (108, 124), (209, 209), (5, 5)])
def test_frames_snap_up_to_17n_plus_5(n, aligned):
    assert align_frames(n) == aligned
    assert aligned % 17 == 5


@pytest.mark.parametrize(("frames", "latent"), [(5, 2), (22, 7), (107, 32), (209, 62)])
def test_latent_frames(frames, latent):
    assert latent_frames(frames) == latent


def test_four_seconds_is_107_frames_and_178_audio_latents():
    r = resolve(duration=4.0)
    assert (r.num_frames, r.num_latent_frames, r.num_audio_latents) == (107, 32, 178)
    assert audio_latents(107) == round(107 / 24 * 40)


def test_duration_beats_num_frames_and_defaults_per_task():
    assert resolve(duration=4.0, num_frames=29).num_frames == 107  # docs/contracts-status.md: duration overrides num_frames
    assert resolve(num_frames=120).num_frames == 124
    assert resolve().num_frames == 209
    assert resolve(media=[MediaSummary("image", "reference", size=(512, 512))], deployment=REF2VA,
                   extra={}).num_frames == 124
    assert resolve_request(prompt="x", negative_prompt=None, params=SamplingParams(), extra={"aspect_ratio": "1:1"},
                           media=(), deployment=FL2VA, default_frames=107).num_frames == 107


def test_duration_limits_name_the_field():
    assert field_of(resolve, duration=3.9) == "params.duration"
    assert field_of(resolve, num_frames=95) == "params.num_frames"
    assert field_of(resolve, extra={"aspect_ratio": "1:1", "duration": 15.2}) == "extra.duration"
    assert resolve(duration=15.0).num_frames == 362  # the requested 360 frames are within 15 s, then snap up


def test_frame_cap_and_its_message_follow_the_17n_plus_5_rule():
    """15 s is 360 frames, which generate 362: the cap is 362 frames, and the message says so (it said "at most
    360 frames" while 15 s gave 362)."""
    from omni_minimax_h3.request_rules import frame_limits

    assert frame_limits(15.0) == (96, 362)
    assert resolve(num_frames=362).num_frames == 362  # what 15 s generates is accepted when asked for directly
    assert resolve(num_frames=361).num_frames == 362
    with pytest.raises(InvalidRequest) as info:
        resolve(num_frames=363)  # snaps up to 379
    assert info.value.field == "params.num_frames"
    assert "at most 362 frames" in str(info.value) and "363 frames (-> 379)" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        resolve(duration=16.0)
    assert "at most 362 frames" in str(info.value) and "16 s = 384 frames" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        resolve(num_frames=95)
    assert "at least 4 s (96 frames" in str(info.value)
    assert resolve(num_frames=96).num_frames == 107


def test_duration_given_twice_must_agree():
    assert field_of(resolve, duration=4.0, extra={"aspect_ratio": "1:1", "duration": 5.0}) == "extra.duration"
    assert resolve(duration=4.0, extra={"aspect_ratio": "1:1", "duration_seconds": 4.0}).num_frames == 107


# ---------------------------------------------------------------------------------------------- canvas


@pytest.mark.parametrize("ratio", ["21:9", "16:9", "4:3", "1:1", "3:4", "9:16"])
def test_release_canvas_matches_diffusers(ratio):
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import resolve_canvas_size

    aw, ah = (int(x) for x in ratio.split(":"))
    r = resolve(extra={"aspect_ratio": ratio})
    assert (r.height, r.width) == resolve_canvas_size(aw, ah, 32, 768, 768 * 1344)
    if ratio == "16:9":
        assert (r.height, r.width) == (768, 1344)


def test_t2va_requires_an_aspect_ratio():
    with pytest.raises(InvalidRequest) as info:
        resolve(extra={})
    assert info.value.field == "extra.aspect_ratio" and "t2va requires an explicit aspect_ratio" in str(info.value)
    assert field_of(resolve, extra={"aspect_ratio": "2:1"}) == "extra.aspect_ratio"


def test_explicit_size_wins_and_must_be_on_the_grid():
    r = resolve(height=288, width=480)
    assert (r.height, r.width) == (288, 480)
    assert field_of(resolve, height=64) == "params.width"
    assert field_of(resolve, height=32, width=320) == "params.width"  # 10:1 is outside 1:4 .. 4:1


@pytest.mark.parametrize(("height", "width", "field", "nearest"), [
    (50, 100, "params.width", ["128x64", "96x64", "96x32", "128x32"]),  # 2:1 first, not the floored 3:1
    (300, 500, "params.width", ["480x288", "512x320", "512x288", "480x320"]),
    (300, 512, "params.height", ["512x288", "512x320"]),
])
def test_off_grid_sizes_are_refused_naming_the_nearest_valid_ones(height, width, field, nearest):
    """Never floored silently (the CLI turned 100x50 into 96x32, i.e. 2:1 into 3:1, while HTTP refused it)."""
    with pytest.raises(InvalidRequest) as info:
        resolve(height=height, width=width, extra={})
    assert info.value.field == field
    assert f"nearest valid sizes: {', '.join(nearest)}" in str(info.value)


def test_t2va_derives_the_aspect_ratio_from_a_matching_size():
    assert (resolve(height=256, width=448, extra={}).width, resolve(height=256, width=448, extra={}).height) \
        == (448, 256)  # 16:9 on the 32 grid
    assert resolve(height=768, width=1344, extra={}).task == "t2va"  # the release's 16:9 canvas
    assert resolve(height=512, width=288, extra={}).width == 288  # 9:16 exactly
    tiny = Deployment(canvas_short_edge=64, canvas_max_pixels=64 * 112)
    assert resolve(height=64, width=128, extra={}, deployment=tiny).width == 128  # the tiny preset's 16:9
    with pytest.raises(InvalidRequest) as info:
        resolve(height=256, width=640, extra={})  # 2.5:1 is none of them
    assert info.value.field == "extra.aspect_ratio" and "nearest: 21:9" in str(info.value)
    assert resolve(height=256, width=640, extra={"aspect_ratio": "21:9"}).width == 640  # the nearest agrees


def test_an_aspect_ratio_contradicting_the_size_names_both_fields():
    with pytest.raises(InvalidRequest) as info:
        resolve(height=256, width=256, extra={"aspect_ratio": "9:16"})
    assert info.value.field == "extra.aspect_ratio"
    assert "9:16 contradicts params.width x params.height = 256x256, which matches 1:1" in str(info.value)
    r = resolve(height=256, width=448, extra={"aspect_ratio": "16:9"})  # agreeing ones are fine
    assert (r.height, r.width) == (256, 448)
    keyframe = resolve(media=[img("first_frame")], height=256, width=256, extra={"aspect_ratio": "1:1"})
    assert keyframe.task == "fl2va"
    assert field_of(resolve, media=[img("first_frame")], height=256, width=256,
                    extra={"aspect_ratio": "16:9"}) == "extra.aspect_ratio"


def test_canvas_multiple_and_partition_shifts_come_from_the_deployment():
    coarse = Deployment(canvas_multiple=64)
    assert field_of(resolve, height=288, width=512, deployment=coarse) == "params.height"
    per = Deployment(partitions=("fl2va", "ref2va"), partition_shifts={"ref2va": (7.0, 2.0)})
    assert (resolve(deployment=per).video_shift, resolve(deployment=per).audio_shift) == (12.0, 3.0)
    r = resolve(media=[MediaSummary("image", "reference", size=(512, 512))], extra={}, deployment=per)
    assert (r.video_shift, r.audio_shift) == (7.0, 2.0)


def test_tiny_canvas():
    assert canvas_for_ratio(16, 9, short_edge=64, max_pixels=64 * 112) == (64, 128)


# ---------------------------------------------------------------------------------------------- tasks


def test_task_inference():
    assert resolve().task == "t2va"
    assert resolve(media=[img("first_frame")], extra={}).task == "fl2va"
    assert resolve(media=[img("reference")], extra={}, deployment=BOTH).task == "ref2va"
    assert resolve(media=[img("reference")], extra={}, deployment=REF2VA).task == "ref2va"
    assert field_of(resolve, extra={}, deployment=REF2VA) == "inputs"  # ref2va needs a reference
    assert field_of(resolve, media=[img("reference")], extra={}) == "inputs"  # FL2VA-only deployment
    assert field_of(resolve, extra={"task": "ref2va"}) == "extra.task"
    assert field_of(resolve, extra={"task": "v2v"}) == "extra.task"


def test_mixed_roles_are_rejected():
    assert field_of(resolve, media=[img("first_frame"), img("reference")], extra={}, deployment=BOTH) \
        == "inputs[0].role"
    assert field_of(resolve, media=[img("first_frame")], extra={"task": "t2va", "aspect_ratio": "1:1"}) \
        == "inputs[0].role"


def test_fl2va_keyframes_and_canvas_from_the_first():
    r = resolve(media=[img("last_frame", 300, 400), img("first_frame", 800, 450)], extra={})
    assert r.keyframes == ((1, "first"), (0, "last"))
    assert (r.height, r.width) == (768, 1344)  # the first keyframe (packed order) is 16:9
    last_only = resolve(media=[img("last_frame", 450, 800)], extra={})
    assert last_only.keyframes == ((0, "last"),) and (last_only.height, last_only.width) == (1344, 768)
    assert resolve(media=[img("first_frame")], extra={"frame_indices": [-1]}).keyframes == ((0, "last"),)
    assert field_of(resolve, media=[img("first_frame")], extra={"frame_indices": [0, -1]}) == "extra.frame_indices"
    assert field_of(resolve, media=[img("first_frame"), img("first_frame")], extra={}) == "inputs[1].role"
    assert field_of(resolve, media=[MediaSummary("video", "first_frame")], extra={}) == "inputs[0].kind"


def test_ref2va_limits():
    def refs(*items):
        return resolve(media=list(items), extra={}, deployment=REF2VA)

    image = MediaSummary("image", "reference", size=(512, 512))
    audio = MediaSummary("audio", "reference", duration_s=3.0)
    assert refs(image, audio).references == (0, 1)
    assert field_of(refs, *[image] * 10) == "inputs[9]"
    assert field_of(refs, audio) == "inputs"  # audio alone
    assert field_of(refs, image, *[audio] * 4) == "inputs[4]"
    assert field_of(refs, MediaSummary("image", "reference", size=(200, 512))) == "inputs[0].data"  # side < 256
    assert field_of(refs, MediaSummary("image", "reference", size=(1400, 512))) == "inputs[0].data"  # ratio > 2.5
    assert field_of(refs, image, MediaSummary("audio", "reference", duration_s=1.0)) == "inputs[1].data"
    assert field_of(refs, image, *[MediaSummary("audio", "reference", duration_s=6.0)] * 3) == "inputs"
    r = refs(image)
    assert (r.height, r.width) == (768, 1344)  # ref2va defaults to 16:9


# ---------------------------------------------------------------------------------------------- others


def test_fixed_fps_no_guidance_no_negative_prompt():
    assert field_of(resolve, fps=30.0) == "params.fps"
    assert resolve(fps=24.0).num_frames == 209
    assert field_of(resolve, guidance_scale=5.0) == "params.guidance_scale"
    assert field_of(resolve, negative_prompt="blurry") == "negative_prompt"


def test_steps_shifts_pad_and_unknown_fields():
    r = resolve()
    assert (r.steps, r.video_shift, r.audio_shift, r.pad_seq_len) == (49, 12.0, 3.0, None)
    r = resolve(num_inference_steps=4, flow_shift=5.0, extra={"aspect_ratio": "1:1", "audio_flow_shift": 2.0,
                                                              "pad_seq_len": 4096})
    assert (r.steps, r.video_shift, r.audio_shift, r.pad_seq_len) == (4, 5.0, 2.0, 4096)
    assert field_of(resolve, extra={"aspect_ratio": "1:1", "pad_seq_len": 100}) == "extra.pad_seq_len"
    assert field_of(resolve, extra={"aspect_ratio": "1:1", "audio_flow_shift": -1}) == "extra.audio_flow_shift"
    assert field_of(lambda extra: check_extra(extra, MODEL_SPEC), extra={"aspect_ratio": "1:1", "cfg_scale": 3}) \
        == "extra.cfg_scale"  # the core checks the spec's declared extra_fields
    assert field_of(resolve, prompt="   ") == "prompt"
    assert resolve(num_outputs=3).num_outputs == 3


def test_ref2va_video_references():
    video = MediaSummary("video", "reference", size=(320, 180), duration_s=2.0)
    r = resolve(media=[video, MediaSummary("audio", "reference", duration_s=3.0)], extra={}, deployment=REF2VA)
    assert r.references == (0, 1)
    assert field_of(resolve, media=[MediaSummary("video", "reference", size=(320, 180), duration_s=0.5)], extra={},
                    deployment=REF2VA) == "inputs[0].data"  # under 22 frames at 24 fps
    assert field_of(resolve, media=[MediaSummary("video", "reference", size=(900, 200), duration_s=2.0)], extra={},
                    deployment=REF2VA) == "inputs[0].data"  # wider than 4:1
    assert field_of(resolve, media=[video] * 4, extra={}, deployment=REF2VA) == "inputs[3]"


def test_the_spec_declares_the_frame_cap_the_rules_apply():
    from omni_minimax_h3.plugin import CAPABILITIES

    assert CAPABILITIES.max_frames == 362 == resolve(duration=15.0).num_frames
