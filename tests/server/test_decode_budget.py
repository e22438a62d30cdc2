"""The server's ``--max-decode-bytes`` budget in process (issue 28 item 2): reserved from headers before decoding,
held by the decoded inputs until they are garbage-collected, never refusing a job accepted before a restart."""

from __future__ import annotations

import gc
import io

import pytest
from omnicore.server import ServerSettings
from omnicore.server.errors import ApiError
from omnicore.server.media import DecodeBudget
from omnicore.server.translate import ServedModel
from omnicore.server.video_media import budget_for, decode
from PIL import Image
from toy.media import TOY_MEDIA_SPEC


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 20, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_budget_refuses_alone_and_when_full_and_returns_shares_when_inputs_are_freed():
    budget = DecodeBudget(1000)
    with pytest.raises(ApiError) as info:
        budget.reserve(1001, param="reference_video")
    assert (info.value.status_code, info.value.code) == (400, "decode_too_large")
    assert budget.reserve(600, param="a") == 600

    class Held:  # stands in for a decoded clip
        pass

    held = Held()
    budget.hold([held], 600)
    with pytest.raises(ApiError) as info:
        budget.reserve(500, param="b")
    assert (info.value.status_code, info.value.code) == (429, "decode_budget_exhausted")
    assert info.value.headers.get("Retry-After")
    del held
    gc.collect()
    assert budget.used == 0 and budget.reserve(1000, param="c") == 1000
    assert DecodeBudget(0).reserve(10**12, param="d") == 0  # 0 = no budget


def test_decode_reserves_from_headers_and_a_restarted_job_is_never_refused(tmp_path):
    served = ServedModel.from_spec(TOY_MEDIA_SPEC)
    settings = ServerSettings(state_dir=tmp_path, max_decode_bytes=100 * 100 * 3)
    png = _png(100, 100)
    media = decode([("reference_images", png)], served, settings)
    budget = budget_for(settings)
    assert budget.used == 100 * 100 * 3 and media[0][1].size == (100, 100)
    with pytest.raises(ApiError) as info:  # full while the first request's image is alive
        decode([("reference_images", png)], served, settings)
    assert info.value.code == "decode_budget_exhausted" and info.value.param == "reference_images"
    again = decode([("reference_images", png)], served, settings, admitted=True)  # re-enqueued after restart
    assert budget.used == 2 * 100 * 100 * 3
    with pytest.raises(ApiError) as info:
        decode([("reference_images", _png(101, 100))], served, settings)
    assert (info.value.status_code, info.value.code) == (400, "decode_too_large")
    del media, again
    gc.collect()
    assert budget.used == 0


def test_edit_images_are_header_checked_and_budgeted_before_decoding(tmp_path):
    from omnicore.server.media import decode_images

    settings = ServerSettings(state_dir=tmp_path, max_decode_bytes=2 * 100 * 100 * 3, max_input_image_pixels=20_000)
    png = _png(100, 100)
    with pytest.raises(ApiError) as info:  # two images over the whole budget: refused before either is decoded
        decode_images([png, png, png], param="image", settings=settings)
    assert (info.value.status_code, info.value.code) == (400, "decode_too_large")
    assert budget_for(settings).used == 0
    with pytest.raises(ApiError) as info:
        decode_images([png, _png(200, 150)], param="image", settings=settings)
    assert (info.value.code, info.value.param) == ("image_too_large", "image") and "200x150" in info.value.message
    held = decode_images([png, png], param="image", settings=settings)
    assert [im.size for im in held] == [(100, 100), (100, 100)]
    with pytest.raises(ApiError) as info:
        decode_images([png], param="image", settings=settings)
    assert info.value.status_code == 429
    del held
    gc.collect()
    assert budget_for(settings).used == 0
