"""Work limits over a model's own extra stages (``StageWork`` in ``request.stages``, e.g. LingBot's refiner):
each stage is held to the per-frame limits and counted into the job's ``--max-work`` total, naming its field."""

from __future__ import annotations

import pytest
from omnicore.engine.limits import STAGES_KEY, LimitExceeded, StageWork, WorkLimits, check_limits, declared_stages
from omnicore.engine.request import GenerationRequest, SamplingParams

SERVER = WorkLimits(max_pixels=64 * 64, max_work=200_000, source="the server")


def _request(*stages: StageWork) -> GenerationRequest:
    params = SamplingParams(height=32, width=32, num_frames=5, num_inference_steps=3)  # 15,360 work units
    return GenerationRequest("x", params, stages=stages, prepared=True)


def _stage(**kw) -> StageWork:
    base = dict(name="refiner", width=64, height=48, num_frames=5, steps=8, size_field="extra.refiner_height",
                steps_field="extra.refiner_steps", work_field="extra.refiner_steps")
    return StageWork(**{**base, **kw})


def test_a_stage_within_the_budget_passes_and_its_work_is_counted():
    check_limits(_request(_stage()), SERVER)  # 15,360 + 122,880 <= 200,000
    assert _stage().work == 64 * 48 * 5 * 8
    with pytest.raises(LimitExceeded) as info:
        check_limits(_request(_stage(), _stage()), SERVER)  # two stages: 261,120 in all
    err = info.value
    assert err.limit == "max_work" and err.field == "extra.refiner_steps" and err.code == "limit_exceeded"
    assert "261120" in err.rule and "--max-work" in err.rule


def test_the_work_budget_covers_a_stage_the_base_alone_would_pass():
    check_limits(_request(), SERVER)
    with pytest.raises(LimitExceeded) as info:
        check_limits(_request(_stage(steps=1000)), SERVER)
    assert info.value.field == "extra.refiner_steps" and "refiner stage is 64x48 x 5 frames x 1000 steps" in \
        info.value.rule


def test_a_stage_is_held_to_the_pixel_limits():
    with pytest.raises(LimitExceeded) as info:
        check_limits(_request(_stage(width=4096, height=4096, steps=1)), SERVER)
    assert info.value.field == "extra.refiner_height" and info.value.code == "image_too_large"
    assert "--max-image-pixels" in info.value.rule
    model = WorkLimits(max_steps=10, max_pixel_frames=64 * 48 * 4, source="model m")
    with pytest.raises(LimitExceeded, match="of model m") as info:
        check_limits(_request(_stage(steps=11)), model)
    assert info.value.limit == "max_steps" and info.value.field == "extra.refiner_steps"
    with pytest.raises(LimitExceeded) as info:
        check_limits(_request(_stage(steps=1)), model)
    assert info.value.limit == "max_pixel_frames" and info.value.field == "extra.refiner_height"


def test_no_limits_no_check_and_malformed_declarations_are_bugs():
    check_limits(_request(_stage(width=10**5, height=10**5, steps=10**6)))
    assert declared_stages(_request()) == ()
    bad = GenerationRequest("x", SamplingParams(), stages=({"width": 1},), prepared=True)
    with pytest.raises(TypeError, match="StageWork"):
        check_limits(bad, SERVER)


def test_the_older_extra_key_is_still_read():
    legacy = GenerationRequest("x", SamplingParams(), extra={STAGES_KEY: (_stage(),)}, prepared=True)
    assert declared_stages(legacy) == (_stage(),)
