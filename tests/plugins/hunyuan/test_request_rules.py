"""HunyuanImage-3 request rules: nothing a client set is changed or dropped silently (issue 28 item 9).

An explicit size must be one of the resolution buckets (else refused naming the nearest ones); a size left out is
snapped; an unknown model-specific field (``extra`` / HTTP ``model_params``, or a prompt-mapping key) is refused
with the ``unknown_parameter`` code.
"""

from __future__ import annotations

import pytest
from _hunyuan_helpers import request
from omni_hunyuan.buckets import ResolutionGroup
from omni_hunyuan.plugin import MODEL_SPEC
from omni_hunyuan.request_rules import EXTRA_FIELDS, nearest_sizes, snap_size
from omnicore.engine.inputs import check_extra
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.errors import InvalidRequest


def test_explicit_sizes_must_be_buckets():
    group = ResolutionGroup(256)
    bucket = snap_size(256, 256, group, explicit=True)
    assert (bucket.height, bucket.width) == (256, 256)
    for (h, w), nearest in (((64, 64), "256x256"), ((4128, 4128), "256x256"), ((240, 256), "272x240")):
        derived = snap_size(h, w, group)  # a size the client left out: snapped (the reference's rule)
        assert f"{derived.width}x{derived.height}" == nearest
        with pytest.raises(InvalidRequest) as info:
            snap_size(h, w, group, explicit=True)
        assert info.value.field == "params.height"
        assert f"{w}x{h} is not one of this model's sizes" in info.value.rule
        assert f"nearest: {nearest} or " in info.value.rule


def test_nearest_sizes_are_usable_buckets_closest_in_ratio():
    group = ResolutionGroup(256)
    near = nearest_sizes(240, 256, group)
    assert [(b.width, b.height) for b in near] == [(272, 240), (256, 256), (288, 224)]
    ratios = [abs(b.ratio - 240 / 256) for b in near]
    assert ratios == sorted(ratios)
    micro = ResolutionGroup(64)  # base 64: most buckets are not multiples of 16, and are never offered
    assert all(b.height % 16 == 0 and b.width % 16 == 0 for b in nearest_sizes(60, 68, micro, count=10))


def test_pipeline_refuses_an_explicit_non_bucket_size_and_snaps_a_derived_one(pipe):
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(request(height=48, width=48))  # micro checkpoint: base 64
    assert info.value.field == "params.height" and "nearest: 64x64" in info.value.rule
    with pytest.raises(InvalidRequest, match="not one of this model's sizes"):
        pipe.preprocess(request(height=4128, width=4128))
    ok = pipe.preprocess(request(height=48, width=80))  # a bucket: kept as given
    assert (ok.params.height, ok.params.width) == (48, 80)
    auto = pipe.preprocess(request(height=None, width=None))  # left out: the base size
    assert (auto.params.height, auto.params.width) == (64, 64)


@pytest.mark.parametrize("extra", [{"foo": 1}, {"bot_task": "image", "cfg_scale": 2.0}, {"size": "64x64"}])
def test_unknown_extra_fields_are_refused_by_name(pipe, extra):
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(request(extra=extra))
    (unknown,) = [k for k in extra if k not in EXTRA_FIELDS]
    assert info.value.field == f"extra.{unknown}" and info.value.code == "unknown_parameter"
    assert "bot_task" in info.value.rule  # says what is accepted


def test_every_field_the_pipeline_reads_is_accepted(pipe):
    check_extra({k: None for k in EXTRA_FIELDS}, MODEL_SPEC)
    extra = {"mode": "t2i", "bot_task": "image", "use_system_prompt": "en_vanilla", "ar_generated_text": "</think>",
             "sequence_template": "instruct", "drop_think": False, "guidance_rescale": 0.5}
    assert set(extra) <= set(EXTRA_FIELDS)
    assert pipe.preprocess(request(extra=extra)).plan.guidance_rescale == 0.5


def test_unknown_prompt_mapping_keys_are_refused(pipe):
    params = SamplingParams(height=64, width=64, num_inference_steps=2, seed=1)
    with pytest.raises(InvalidRequest) as info:
        pipe.preprocess(GenerationRequest({"prompt": "a fox", "colour": "red"}, params))
    assert info.value.field == "prompt.colour" and info.value.code == "unknown_parameter"
