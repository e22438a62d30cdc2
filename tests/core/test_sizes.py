"""``omnicore.sizes.parse_size_wh``: the one ``"WIDTHxHEIGHT"`` parser, ``(width, height)`` in that order.

The server and the LingBot request rules had one each, returning opposite orders; both now call this one.
"""

from __future__ import annotations

import pytest
from omnicore.errors import InvalidRequest
from omnicore.plugin import parse_size_wh
from omnicore.server.errors import ApiError
from omnicore.server.translate import request_size


@pytest.mark.parametrize("text", ["832x480", "832X480", "832×480", "832*480", " 832 x 480 "])
def test_width_comes_first(text: str) -> None:
    assert parse_size_wh(text) == (832, 480)


@pytest.mark.parametrize("value", ["big", "832x", "x480", "832x480x3", "-16x16", "8.5x16", None, 832, ("832", "480")])
def test_anything_else_names_the_field(value: object) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_size_wh(value, "extra.size")
    assert info.value.field == "extra.size" and "WIDTHxHEIGHT" in info.value.rule


def test_minimum_side() -> None:
    assert parse_size_wh("16x16", minimum=16) == (16, 16)
    with pytest.raises(InvalidRequest, match="at least 16, got 8x32"):
        parse_size_wh("8x32", minimum=16)
    assert parse_size_wh("1x1") == (1, 1)
    with pytest.raises(InvalidRequest):
        parse_size_wh("0x16")


def test_the_server_reads_sizes_with_it() -> None:
    assert request_size("640x480") == (640, 480)  # width first, as the HTTP `size` says
    assert request_size("auto") is None and request_size(None) is None
    for bad in ("big", "8x8"):
        with pytest.raises(ApiError) as info:
            request_size(bad)
        assert info.value.status_code == 400 and info.value.param == "size" and info.value.code == "invalid_value"
