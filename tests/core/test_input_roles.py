"""The HTTP server gates conditioning media with the engine's own input rules (``check_input_roles``).

The server had a copy of ``engine.inputs.check_inputs`` (``translate.video_inputs``) so its errors could name the
form field; both now run one function, so they refuse the same requests for the same reason.
"""

from __future__ import annotations

import pytest
from omnicore.engine.inputs import check_input_roles, check_inputs
from omnicore.engine.request import GenerationRequest, MediaInput
from omnicore.errors import InvalidRequest
from omnicore.server.errors import ApiError
from omnicore.server.translate import VIDEO_MEDIA_FIELDS, ServedModel, video_inputs
from omnicore.specs import InputRole, ModelCapabilities, ModelSpec

CAPS = ModelCapabilities(
    modes=("t2v",), outputs=("video",), max_inputs=4,
    inputs=(InputRole("first_frame", ("image",), 1, "first frame"), InputRole("last_frame", ("image",), 1, "last"),
            InputRole("reference", ("image", "video"), 3, "references")))
SPEC = ModelSpec(name="rolesy", impl="pkg.pipe:Pipe", capabilities=CAPS)
SERVED = ServedModel.from_spec(SPEC)

CASES = [
    ["input_reference"],
    ["input_reference", "last_frame", "reference_images", "reference_video"],
    ["input_reference", "input_reference"],
    ["reference_images"] * 4,
    ["reference_images", "reference_images", "reference_video", "reference_video"],
    ["reference_audio"],
    ["input_reference", "last_frame", "reference_images", "reference_images", "reference_images"],
]


def _engine_outcome(fields: list[str]) -> tuple[int | None, str | None]:
    """(index of the input the engine refuses, error code), or (None, None) when it takes them."""
    inputs = tuple(MediaInput(*VIDEO_MEDIA_FIELDS[f], data=None) for f in fields)
    try:
        check_inputs(GenerationRequest(prompt="p", inputs=inputs), CAPS, SPEC.name)
    except InvalidRequest as exc:
        index = int(exc.field.split("[")[1].split("]")[0]) if "[" in exc.field else CAPS.max_inputs
        return index, exc.code or "invalid_value"
    return None, None


@pytest.mark.parametrize("fields", CASES)
def test_the_server_refuses_exactly_what_the_engine_refuses(fields: list[str]) -> None:
    index, code = _engine_outcome(fields)
    if index is None:
        assert [(m.kind, m.role) for m in video_inputs(SERVED, [(f, None) for f in fields])] == [
            VIDEO_MEDIA_FIELDS[f] for f in fields]
        return
    with pytest.raises(ApiError) as info:
        video_inputs(SERVED, [(f, None) for f in fields])
    assert info.value.status_code == 400
    assert (info.value.param, info.value.code) == (fields[index], code)  # the form field of the refused input


def test_fields_name_the_inputs_in_errors() -> None:
    inputs = [MediaInput("image", "reference", None)] * 4
    with pytest.raises(InvalidRequest) as info:
        check_input_roles(inputs, CAPS, "rolesy", fields=["a", "b", "c", "d"])
    assert info.value.field == "d" and info.value.code == "too_many_input_images"
    with pytest.raises(InvalidRequest) as plain:
        check_input_roles(inputs, CAPS, "rolesy")
    assert plain.value.field == "inputs[3]"
