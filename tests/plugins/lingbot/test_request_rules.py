"""LingBot request rules: the reference's tables (docs/contracts-status.md C8.2,)."""

from __future__ import annotations

import json

import pytest
from omni_lingbot import request_rules as rr
from omni_lingbot.prompts import DEFAULT_NEGATIVE_PROMPT_IMAGE, DEFAULT_NEGATIVE_PROMPT_VIDEO
from omnicore.engine.request import SamplingParams
from omnicore.errors import InvalidRequest

# ---------------------------------------------------------------------------------------------- mode


@pytest.mark.parametrize(("modalities", "images", "mode"), [
    (["image"], 0, "t2i"),
    (["video"], 0, "t2v"),
    (["video"], 1, "ti2v"),
    (None, 0, "t2v"),  # legacy: no modalities, no image
])
def test_mode_table(modalities, images, mode):
    assert rr.resolve_mode(modalities, images) == mode


@pytest.mark.parametrize(("kwargs", "gist", "field"), [
    ({"modalities": ["image"], "num_images": 1}, "does not accept", "images"),
    ({"modalities": ["video"], "num_images": 2}, "exactly one", "images"),
    ({"modalities": ["video"], "num_images": 0, "num_videos": 1}, "reference modalities", "references"),
    ({"modalities": ["video"], "num_images": 0, "num_audios": 1}, "reference modalities", "references"),
    ({"modalities": None, "num_images": 1}, "explicitly set", "modalities"),
    ({"modalities": ["audio"], "num_images": 0}, "output modality", "modalities"),
])
def test_mode_errors(kwargs, gist, field):
    modalities = kwargs.pop("modalities")
    images = kwargs.pop("num_images")
    with pytest.raises(InvalidRequest, match=gist) as info:
        rr.resolve_mode(modalities, images, **kwargs)
    assert info.value.field == field


def test_output_type_stands_in_for_missing_modalities():
    assert rr.resolve_mode(None, 0, output_type="image") == "t2i"
    assert rr.resolve_mode(None, 1, output_type="video") == "ti2v"


# ---------------------------------------------------------------------------------------------- caption


def test_caption_rules():
    assert rr.resolve_caption("a red fox") == "a red fox"
    assert rr.resolve_caption({"caption": "a red fox", "duration": 4}) == "a red fox"
    structured = {"subject": "fox", "colour": "rouge é"}
    assert rr.resolve_caption({"caption": structured}) == '{"subject":"fox","colour":"rouge é"}'
    # without caption: the descriptive keys in order, control keys removed
    got = rr.resolve_caption({"scene": "forest", "duration": 4, "fps": 24, "size": "320x192", "mood": "calm"})
    assert got == '{"scene":"forest","mood":"calm"}'
    assert json.loads(got) == {"scene": "forest", "mood": "calm"}


@pytest.mark.parametrize("prompt", [{"duration": 4, "fps": 24}, {"caption": ""}, "", "   "])
def test_empty_caption_is_rejected(prompt):
    with pytest.raises(InvalidRequest, match="must not be empty"):
        rr.resolve_caption(prompt)


# ---------------------------------------------------------------------------------------------- frames


@pytest.mark.parametrize(("n", "expected"), [(1, 1), (2, 5), (4, 5), (5, 5), (96, 97), (98, 101), (121, 121)])
def test_round_up_frames(n, expected):
    assert rr.round_up_frames(n) == expected
    assert rr.resolve_num_frames("t2v", ("params.num_frames", n), None, 24.0) == expected


@pytest.mark.parametrize("bad", [0, -3, 1.5, "9", None, True])
def test_bad_num_frames(bad):
    with pytest.raises(InvalidRequest, match="num_frames"):
        rr.check_num_frames(bad)


@pytest.mark.parametrize(("duration", "fps", "expected"), [
    (4, 24, 97), (5, 24, 121), (8, 24, 193), (4, 12, 49), (4, 30, 121), (4, 24.0, 97),
    # the reference truncates duration x fps, then rounds up with ceil((n - 1) / 4) * 4 + 1, so a count already
    # on the 4k+1 grid stays where it is (1 s at 25 fps is 25 frames, not 29)
    (1, 25, 25), (0.25, 20, 5), (1.05, 24, 25), (1, 24, 25), (1, 26, 29), (0.04, 25, 1),
])
def test_frames_from_duration(duration, fps, expected):
    assert rr.frames_from_duration(duration, fps) == expected


@pytest.mark.parametrize(("duration", "fps", "gist"), [
    (0, 24, "duration"), (-1, 24, "duration"), (4, 0, "fps"), (4, 23.976, "whole number"), (4, True, "fps"),
    (0.01, 24, "at least one frame"),  # int(0.24) = 0 frames: refused, as the reference does
])
def test_bad_duration(duration, fps, gist):
    with pytest.raises(InvalidRequest, match=gist):
        rr.frames_from_duration(duration, fps)


def test_frame_priority():
    # explicit num_frames beats duration, duration beats the default 81
    assert rr.resolve_num_frames("t2v", ("params.num_frames", 9), ("extra.duration", 4), 24.0) == 9
    assert rr.resolve_num_frames("t2v", None, ("extra.duration", 4), 24.0) == 97
    assert rr.resolve_num_frames("t2v", None, None, 24.0) == 81


@pytest.mark.parametrize(("prompt", "extra", "params_duration", "field"), [
    ({}, {"seconds": 4, "duration": 4}, None, "extra.seconds"),
    ({}, {"seconds": 4}, 4.0, "params.duration"),  # the server stores the API's `seconds` as params.duration
    ({}, {"duration": 4}, 4.0, "params.duration"),
    ({"seconds": 4, "duration": 4}, {}, None, "prompt.seconds"),
])
def test_seconds_and_duration_conflict(prompt, extra, params_duration, field):
    with pytest.raises(InvalidRequest, match="seconds.*duration") as info:
        rr.pick_duration(prompt, extra, params_duration)
    assert info.value.field == field


def test_duration_sources_and_priority():
    assert rr.pick_duration({}, {}, None) is None
    assert rr.pick_duration({}, {"seconds": 3}) == ("extra.seconds", 3)
    assert rr.pick_duration({}, {}, 2.0) == ("params.duration", 2.0)
    # the prompt mapping beats the request, and naming it at both levels is not a conflict
    assert rr.pick_duration({"seconds": 1}, {"duration": 4}, 2.0) == ("prompt.seconds", 1)


def test_text_to_image_frame_rules():
    assert rr.resolve_num_frames("t2i", None, None, 24.0) == 1
    assert rr.resolve_num_frames("t2i", ("params.num_frames", 1), None, 24.0) == 1
    with pytest.raises(InvalidRequest, match="text-to-image requires"):
        rr.resolve_num_frames("t2i", ("params.num_frames", 5), None, 24.0)
    with pytest.raises(InvalidRequest, match="text-to-image.*duration"):
        rr.resolve_num_frames("t2i", None, ("extra.duration", 2), 24.0)


# ---------------------------------------------------------------------------------------------- size

REFERENCE_PRESETS = {  # (height, width) exactly as docs/contracts-status.md C8.5 lists them
    ("192p", "1:1"): (192, 192), ("192p", "9:16"): (192, 320), ("192p", "16:9"): (320, 192),
    ("192p", "3:4"): (192, 256), ("192p", "4:3"): (256, 192),
    ("480p", "1:1"): (480, 480), ("480p", "9:16"): (480, 832), ("480p", "16:9"): (832, 480),
    ("480p", "3:4"): (480, 640), ("480p", "4:3"): (640, 480),
    ("720p", "1:1"): (736, 736), ("720p", "9:16"): (736, 1280), ("720p", "16:9"): (1280, 736),
    ("720p", "3:4"): (736, 960), ("720p", "4:3"): (960, 736),
    ("1080p", "1:1"): (1088, 1088), ("1080p", "9:16"): (1088, 1920), ("1080p", "16:9"): (1920, 1088),
    ("1080p", "3:4"): (1088, 1440), ("1080p", "4:3"): (1440, 1088),
    ("2k", "1:1"): (1440, 1440), ("2k", "9:16"): (1440, 2560), ("2k", "16:9"): (2560, 1440),
    ("2k", "3:4"): (1440, 1920), ("2k", "4:3"): (1920, 1440),
    ("4k", "1:1"): (2176, 2176), ("4k", "9:16"): (2176, 3840), ("4k", "16:9"): (3840, 2176),
    ("4k", "3:4"): (2176, 2880), ("4k", "4:3"): (2880, 2176),
}


@pytest.mark.parametrize(("key", "hw"), sorted(REFERENCE_PRESETS.items()))
def test_resolution_presets(key, hw):
    resolution, ratio = key
    assert rr.resolve_size(resolution=resolution, ratio=ratio) == hw


def test_size_forms_return_height_width():
    assert rr.resolve_size(size="320x192") == (192, 320)
    assert rr.resolve_size(width=320, height=192) == (192, 320)
    assert rr.resolve_size() is None


@pytest.mark.parametrize(("kwargs", "gist", "field"), [
    ({"width": 320}, "provided together", "height"),
    ({"height": 192}, "provided together", "width"),
    ({"resolution": "480p"}, "provided together", "ratio"),
    ({"ratio": "16:9"}, "provided together", "resolution"),
    ({"width": 320, "height": 192, "resolution": "480p", "ratio": "1:1"}, "mutually exclusive", "resolution"),
    ({"width": 320, "height": 192, "size": "320x192"}, "mutually exclusive", "size"),
    ({"width": 321, "height": 192}, "multiples of 16", "width"),
    ({"size": "320x200"}, "multiples of 16", "size"),
    ({"width": 0, "height": 192}, "width", "width"),
    ({"size": "big"}, "WIDTHxHEIGHT", "size"),
    ({"resolution": "360p", "ratio": "1:1"}, "unknown resolution", "resolution"),
    ({"resolution": "480p", "ratio": "2:1"}, "unknown ratio", "ratio"),
])
def test_size_errors(kwargs, gist, field):
    with pytest.raises(InvalidRequest, match=gist) as info:
        rr.resolve_size(**kwargs)
    assert info.value.field == field


# ---------------------------------------------------------------------------------------------- others


def test_shift_rules():
    assert rr.resolve_shift() == 3.0
    assert rr.resolve_shift(shift=5.0, flow_shift=7.0, params_shift=9.0) == 5.0  # shift beats its alias
    assert rr.resolve_shift(flow_shift=7.0, params_shift=9.0) == 7.0
    assert rr.resolve_shift(params_shift=9.0) == 9.0
    for bad in (0, -1.0):
        with pytest.raises(InvalidRequest, match="shift.*positive"):
            rr.resolve_shift(shift=bad)


def test_negative_prompt_defaults():
    assert rr.resolve_negative_prompt(None, "t2v") == DEFAULT_NEGATIVE_PROMPT_VIDEO
    assert rr.resolve_negative_prompt(None, "ti2v") == DEFAULT_NEGATIVE_PROMPT_VIDEO
    assert rr.resolve_negative_prompt(None, "t2i") == DEFAULT_NEGATIVE_PROMPT_IMAGE
    assert DEFAULT_NEGATIVE_PROMPT_IMAGE != DEFAULT_NEGATIVE_PROMPT_VIDEO
    assert rr.resolve_negative_prompt("", "t2v") == ""  # explicit empty is kept
    assert rr.resolve_negative_prompt("ugly", "t2i") == "ugly"
    json.loads(DEFAULT_NEGATIVE_PROMPT_VIDEO)  # the defaults are JSON captions like the positive prompts


def _resolve(prompt="a red fox", *, negative=None, modalities=("video",), images=0, extra=None, **params):
    return rr.resolve_request(prompt=prompt, negative_prompt=negative, modalities=modalities, num_images=images,
                              num_videos=0, num_audios=0, params=SamplingParams(**params), extra=extra or {})


def test_resolve_request_defaults():
    r = _resolve()
    assert (r.mode, r.height, r.width, r.num_frames, r.fps, r.shift) == ("t2v", 480, 480, 81, 24.0, 3.0)
    assert (r.batch_cfg, r.null_cond_clone_zero, r.low_noise.threshold) == (False, False, None)
    assert r.negative_prompt == DEFAULT_NEGATIVE_PROMPT_VIDEO
    assert _resolve(num_frames=9).num_frames == 9


def test_batch_cfg_auto_is_per_platform():
    # left to the platform: packed on CUDA/NPU, two passes on CPU (where lingbot_batch_cfg measures packed slower)
    assert (_resolve().batch_cfg, _resolve().batch_cfg_source) == (False, "auto")
    for device, packed in (("cpu", False), ("cuda", True), ("npu", True), ("mps", False)):
        r = rr.resolve_request(prompt="fox", negative_prompt=None, modalities=("video",), num_images=0, num_videos=0,
                               num_audios=0, params=SamplingParams(), extra={"batch_cfg": "auto"},
                               device_type=device)
        assert (r.batch_cfg, r.batch_cfg_source) == (packed, "auto")
        assert rr.platform_batch_cfg(device) is packed
    for value in (True, False):  # an explicit choice is kept on every platform
        for device in ("cpu", "cuda"):
            assert rr.resolve_batch_cfg({"batch_cfg": value}, device) == (value, "request")


def test_resolve_request_priorities():
    # prompt-dict resolution+ratio beats the request's width/height; a prompt size beats sampling dimensions
    r = _resolve({"caption": "fox", "resolution": "192p", "ratio": "16:9"}, width=64, height=64)
    assert (r.height, r.width) == (320, 192)
    r = _resolve({"caption": "fox", "size": "320x192"}, width=64, height=64)
    assert (r.height, r.width) == (192, 320)
    r = _resolve(extra={"size": "64x32"})
    assert (r.height, r.width) == (32, 64)
    # explicit frames (sampling or prompt dict) beat every duration; prompt duration beats extra
    assert _resolve({"caption": "fox", "num_frames": 9}, extra={"duration": 4}).num_frames == 9
    assert _resolve({"caption": "fox", "duration": 2}, extra={"duration": 4}).num_frames == 49
    assert _resolve(extra={"seconds": 4}).num_frames == 97
    assert _resolve(duration=4.0, fps=12.0).num_frames == 49
    assert _resolve(extra={"shift": 5.0, "flow_shift": 2.0}, flow_shift=1.5).shift == 5.0
    assert _resolve(extra={"negative_prompt": "dull"}).negative_prompt == "dull"
    assert _resolve(negative="grey", extra={"negative_prompt": "dull"}).negative_prompt == "grey"


@pytest.mark.parametrize(("kwargs", "gist", "field"), [
    ({"extra": {"seconds": 4, "duration": 4}}, "seconds.*duration", "extra.seconds"),
    ({"extra": {"seconds": 4}, "duration": 2.0}, "seconds.*duration", "params.duration"),
    ({"extra": {"size": "320x192"}, "width": 320, "height": 192}, "mutually exclusive", "size"),
    ({"num_outputs": 2}, "one output per prompt", "params.num_outputs"),
    ({"extra": {"batch_cfg": "yes"}}, "true or false", "extra.batch_cfg"),
    ({"extra": {"t_thresh": 1.5}}, r"\(0, 1\]", "extra.t_thresh"),
    ({"extra": {"base_sigma_tail_steps": 1001}}, "at most 1000", "extra.base_sigma_tail_steps"),
    ({"modalities": ("image",), "num_frames": 5}, "text-to-image requires", "params.num_frames"),
    ({"modalities": ("image",), "extra": {"duration": 2}}, "duration", "extra.duration"),
    ({"modalities": ("image",), "output_type": "video"}, "produces image output", "params.output_type"),
])
def test_resolve_request_errors(kwargs, gist, field):
    with pytest.raises(InvalidRequest, match=gist) as info:
        _resolve(**kwargs)
    assert info.value.field == field


def test_unknown_extra_field_carries_the_unknown_parameter_code():
    """The spec declares ``extra_fields`` and the core refuses anything else (the rules no longer check)."""
    from omni_lingbot.plugin import MODEL_SPEC
    from omnicore.engine.inputs import check_extra

    assert MODEL_SPEC.extra_fields == rr.EXTRA_FIELDS
    for extra, field in (({"foo": 1}, "extra.foo"), ({"refiner": True}, "extra.refiner")):
        with pytest.raises(InvalidRequest, match="unknown lingbot field") as info:
            check_extra(extra, MODEL_SPEC)
        assert info.value.field == field and info.value.code == "unknown_parameter"


def test_text_to_image_request():
    r = _resolve(modalities=("image",), width=320, height=192)
    assert (r.mode, r.num_frames, r.height, r.width) == ("t2i", 1, 192, 320)
    assert r.negative_prompt == DEFAULT_NEGATIVE_PROMPT_IMAGE
