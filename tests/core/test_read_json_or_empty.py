"""``read_json_or_empty``: optional metadata read the same way by the engine's layout probe and MiniMax-H3's presets."""

from __future__ import annotations

from pathlib import Path

from omnicore.plugin import read_json_or_empty


def test_an_object_is_returned(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text('{"_class_name": "X", "n": [1, 2]}')
    assert read_json_or_empty(tmp_path / "a.json") == {"_class_name": "X", "n": [1, 2]}
    assert read_json_or_empty(str(tmp_path / "a.json"))["n"] == [1, 2]


def test_missing_broken_or_not_an_object_is_empty(tmp_path: Path) -> None:
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bin.json").write_bytes(b"\xff\xfe\x00")
    for name in ("missing.json", "list.json", "bad.json", "bin.json"):
        assert read_json_or_empty(tmp_path / name) == {}
    assert read_json_or_empty(tmp_path) == {}  # a folder is unreadable as a file
