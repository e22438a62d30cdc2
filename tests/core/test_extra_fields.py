"""A model declares its ``extra`` keys (``ModelSpec.extra_fields``) and the core refuses every other one, naming it,
with the ``unknown_parameter`` code (HTTP 400) — one rule for every model instead of a copy per plugin."""

from __future__ import annotations

import pytest
from omnicore.engine.inputs import check_extra, check_request
from omnicore.engine.request import GenerationRequest
from omnicore.errors import InvalidRequest
from omnicore.specs import ModelSpec

SPEC = ModelSpec(name="m", impl="pkg.mod:Cls", extra_fields=["shift", "duration"])


def test_declared_keys_pass_and_unknown_ones_are_named():
    check_extra({"shift": 1.0, "duration": None}, SPEC)
    with pytest.raises(InvalidRequest) as info:
        check_extra({"shift": 1.0, "zeta": 1, "alpha": 2}, SPEC)
    err = info.value
    assert err.field == "extra.alpha" and err.code == "unknown_parameter"
    assert "'alpha', 'zeta'" in err.rule and "accepted: shift, duration" in err.rule


def test_an_undeclared_spec_is_not_checked_and_an_empty_declaration_takes_nothing():
    check_extra({"anything": 1}, ModelSpec(name="m", impl="pkg.mod:Cls"))
    with pytest.raises(InvalidRequest, match="accepted: none"):
        check_extra({"x": 1}, ModelSpec(name="m", impl="pkg.mod:Cls", extra_fields=()))


def test_the_engine_check_covers_extra():
    with pytest.raises(InvalidRequest) as info:
        check_request(GenerationRequest("a fox", extra={"shfit": 2.0}), SPEC)
    assert info.value.field == "extra.shfit"
    assert check_request(GenerationRequest("a fox", extra={"shift": 2.0}), SPEC).extra == {"shift": 2.0}


@pytest.mark.parametrize("module", ["omni_lingbot.plugin", "omni_minimax_h3.plugin", "omni_hunyuan.plugin"])
def test_every_native_model_declares_its_extra_fields(module):
    import importlib

    mod = importlib.import_module(module)
    fields = mod.MODEL_SPEC.extra_fields
    assert fields and len(set(fields)) == len(fields)
