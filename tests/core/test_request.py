"""GenerationRequest / SamplingParams: frozen records whose errors name the field and the rule."""

from __future__ import annotations

import math

import attrs
import pytest
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.errors import InvalidRequest
from omnicore.specs import RequestDefaults


@pytest.mark.parametrize("field,value,rule", [
    ("height", 8, "between 16 and 16384"),
    ("height", 512.0, "must be an integer"),
    ("width", True, "must be an integer"),
    ("num_frames", 0, "between 1 and 100000"),
    ("num_inference_steps", 1001, "between 1 and 1000"),
    ("seed", -1, "between 0 and"),
    ("num_outputs", 0, "between 1 and 64"),
    ("fps", 0, "> 0.0"),
    ("fps", math.nan, "finite number"),
    ("guidance_scale", math.inf, "finite number"),
    ("guidance_scale", -0.5, ">= 0.0"),
    ("flow_shift", "3", "finite number"),
    ("duration", 4000, "<= 3600.0"),
    ("output_type", "gif", "one of"),
])
def test_sampling_param_errors_name_field_and_rule(field, value, rule):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**{field: value})
    assert info.value.field == f"params.{field}"
    assert rule in info.value.rule


def test_ints_are_normalised_for_float_fields():
    p = SamplingParams(fps=24, guidance_scale=5, flow_shift=3)
    assert (p.fps, p.guidance_scale, p.flow_shift) == (24.0, 5.0, 3.0)
    assert all(type(v) is float for v in (p.fps, p.guidance_scale, p.flow_shift))


def test_records_are_frozen():
    p = SamplingParams()
    r = GenerationRequest("x")
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        p.height = 64
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        r.prompt = "y"


def test_with_defaults_fills_only_unset_fields():
    d = RequestDefaults(height=64, width=96, num_frames=9, fps=12.0, num_inference_steps=7, guidance_scale=3.5,
                        flow_shift=2.0)
    p = SamplingParams(height=128, seed=4).with_defaults(d)
    assert (p.height, p.width, p.num_frames, p.fps, p.num_inference_steps, p.guidance_scale, p.flow_shift,
            p.seed) == (128, 96, 9, 12.0, 7, 3.5, 2.0, 4)
    assert SamplingParams().with_defaults(d, width=32).width == 32


@pytest.mark.parametrize("kwargs,field", [
    ({"prompt": "   "}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": "x", "quality": "ultra"}, "quality"),
    ({"prompt": "x", "extra": ["a"]}, "extra"),
    ({"prompt": "x", "params": {"height": 64}}, "params"),
])
def test_request_errors_name_the_field(kwargs, field):
    with pytest.raises(InvalidRequest) as info:
        GenerationRequest(**kwargs)
    assert info.value.field == field


def test_request_normalises_references_and_copies_extra():
    extra = {"k": 1}
    r = GenerationRequest({"scene": "a"}, images=["a.png"], modalities=["video", "audio"], extra=extra)
    extra["k"] = 2
    assert r.images == ("a.png",) and r.modalities == ("video", "audio") and r.extra == {"k": 1}
    assert r.request_id.startswith("req_") and r.request_id != GenerationRequest("x").request_id


def test_batch_key_separates_shapes_schedule_and_inputs():
    base = GenerationRequest("a", SamplingParams(height=64, seed=1))
    assert base.batch_key() == GenerationRequest("b", SamplingParams(height=64, seed=99)).batch_key()
    for other in (base.evolve(params=SamplingParams(height=80)),
                  base.evolve(params=SamplingParams(height=64, num_inference_steps=3)),
                  base.evolve(images=("x.png",))):
        assert other.batch_key() != base.batch_key()


def test_output_seeds_must_stay_in_range():
    from omnicore.engine.request import MAX_SEED

    assert SamplingParams(seed=MAX_SEED - 2, num_outputs=3).seed == MAX_SEED - 2
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(seed=MAX_SEED - 1, num_outputs=3)
    assert info.value.field == "params.seed" and "seed + num_outputs - 1" in info.value.rule


def test_the_plan_slot_is_typed_and_outside_equality_batch_key_and_extra():
    """``plan`` / ``stages`` hold what preprocess decided: not compared, not in the batch key, never in extra."""
    import attrs

    from omnicore.engine.limits import StageWork

    @attrs.frozen
    class Plan:
        mode: str

    base = GenerationRequest("a fox", SamplingParams(height=32, width=32), extra={"k": 1}, request_id="r")
    planned = base.evolve(plan=Plan("t2v"), stages=(StageWork("refiner", 8, 8),), prepared=True)
    assert planned.plan_as(Plan).mode == "t2v" and planned.stages == (StageWork("refiner", 8, 8),)
    assert planned.extra == {"k": 1} and planned.batch_key() == base.batch_key()
    assert planned == base.evolve(prepared=True)  # a plan never makes two requests differ
    assert planned.evolve(prompt="a cat").plan == Plan("t2v")  # evolve keeps it
    with pytest.raises(ValueError, match="carries no plan, not a Plan"):
        base.plan_as(Plan)
    with pytest.raises(ValueError, match="carries a Plan, not a int"):
        planned.plan_as(int)
