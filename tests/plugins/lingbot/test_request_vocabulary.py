"""One vocabulary across the models (issue 18 item 2): a concept every video model takes has the same request field
name in each (``duration``, ``aspect_ratio``, ``flow_shift``), whatever other names a model keeps for its reference
system's contract."""

from __future__ import annotations

import pytest
from omni_lingbot import request_rules as rr
from omni_lingbot.plugin import MODEL_SPEC as LINGBOT
from omni_minimax_h3.plugin import MODEL_SPEC as MINIMAX_H3
from omnicore.errors import InvalidRequest

SHARED = ("duration", "aspect_ratio", "flow_shift")


@pytest.mark.parametrize("spec", [LINGBOT, MINIMAX_H3], ids=lambda s: s.name)
def test_video_models_take_the_shared_names(spec):
    assert set(SHARED) <= set(spec.extra_fields)


def _size(extra):
    return rr.resolve_size(resolution=extra.get("resolution"), ratio=rr.pick_ratio(extra, ""))


def test_lingbot_aspect_ratio_is_its_ratio():
    assert _size({"resolution": "480p", "aspect_ratio": "16:9"}) == _size({"resolution": "480p", "ratio": "16:9"})
    assert _size({"resolution": "480p", "aspect_ratio": "9:16"}) == rr.RESOLUTION_PRESETS["480p"]["9:16"]


def test_lingbot_refuses_both_ratio_names():
    with pytest.raises(InvalidRequest) as info:
        rr.pick_ratio({"aspect_ratio": "16:9", "ratio": "16:9"}, "")
    assert info.value.field == "ratio" and "not both" in str(info.value)

