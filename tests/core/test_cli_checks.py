"""``omnicore generate``: what the spec declares is checked before any load, under the CLI's flag names; the
parser refuses abbreviations and documents every flag (issue 28 §15-§17).

The MiniMax-H3 and LingBot cases run the real CLI in process against the installed plugins: each fails before
a preset is built, which the empty cache proves.
"""

from __future__ import annotations

import argparse
import importlib.util
import time

import pytest
from omnicore.cli.main import build_parser, main


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNICORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OMNICORE_PLUGINS", raising=False)
    return tmp_path / "cache"


@pytest.fixture
def png(tmp_path):
    from PIL import Image

    path = tmp_path / "ref.png"
    Image.new("RGB", (320, 320), (10, 200, 30)).save(path)
    return path


def _one_error_line(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1, lines
    return lines[0]


H3 = pytest.mark.skipif(importlib.util.find_spec("omni_minimax_h3") is None,
                        reason="the MiniMax-H3 plugin (plugins/minimax_h3) is not installed")


@H3
def test_a_required_field_is_named_with_its_flag_before_loading(cache, tmp_path, capsys):
    t0 = time.monotonic()
    assert main(["generate", "tiny:minimax-h3", "a fox", "-o", str(tmp_path / "o.mp4"), "--steps", "1"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("error: --extra aspect_ratio: model minimax-h3 requires aspect_ratio"), line
    assert "16:9" in line and "t2va" in line
    assert not (cache / "presets").exists()  # nothing was built or loaded
    assert time.monotonic() - t0 < 10


@H3
def test_a_reference_on_the_fl2va_preset_names_what_serves_ref2va(cache, tmp_path, png, capsys):
    assert main(["generate", "tiny:minimax-h3", "a fox", "-o", str(tmp_path / "o.mp4"), "--reference", str(png),
                 "--extra", "aspect_ratio=16:9"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: --reference {png}: reference inputs are for ref2va"), line
    assert "tiny:minimax-h3-ref2va" in line and "--model-option partition=ref2va" in line, line
    assert not (cache / "presets").exists()


@H3
def test_sizes_off_the_multiple_suggest_the_nearest(cache, tmp_path, capsys):
    assert main(["generate", "tiny:minimax-h3", "a fox", "-o", str(tmp_path / "o.mp4"), "--height", "70",
                 "--width", "128", "--extra", "aspect_ratio=16:9"]) == 2
    assert _one_error_line(capsys) == "error: --height: 70 is not a multiple of 32 for model minimax-h3; nearest: " \
                                      "64 or 96"
    assert not (cache / "presets").exists()


@H3
def test_a_missing_image_is_named_by_its_flag(cache, tmp_path, capsys):
    assert main(["generate", "tiny:minimax-h3", "a fox", "-o", str(tmp_path / "o.mp4"),
                 "--image", str(tmp_path / "nope.png")]) == 2
    assert _one_error_line(capsys).startswith("error: --image: cannot read"), "--image"


def test_a_model_family_name_says_what_to_pass(cache, tmp_path, capsys):
    pytest.importorskip("omni_lingbot")
    assert main(["generate", "lingbot", "a fox", "-o", str(tmp_path / "o.png")]) == 2
    line = _one_error_line(capsys)
    assert "tiny:lingbot" in line and "checkpoint directory" in line, line
    assert "known:" not in line  # not the list of every registered name


def test_abbreviated_flags_are_errors_with_the_subcommands_usage(cache, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "tiny:toy", "x", "-o", str(tmp_path / "o.png"), "--step", "2"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: omnicore generate" in err and "unrecognized arguments: --step 2" in err, err
    with pytest.raises(SystemExit):
        main(["serve", "tiny:toy", "--prt", "8000"])
    err = capsys.readouterr().err
    assert "usage: omnicore serve" in err and "--prt" in err, err


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    return parser.parse_args(["plugins"])._subparsers[name]


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_has_help_that_states_its_default(command):
    sub = _subparser(command)
    missing = []
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = action.help or ""
        if not text or text == argparse.SUPPRESS:
            missing.append(f"{action.dest}: no help")
        elif action.option_strings and "default" not in text and "required" not in text:
            missing.append(f"{'/'.join(action.option_strings)}: no default in {text!r}")
    assert not missing, missing


def test_serve_help_documents_auto():
    sub = _subparser("serve")
    model = next(a for a in sub._actions if a.dest == "model")
    assert "auto" in model.help and "tiny:lingbot" in model.help


@H3
def test_models_says_which_fields_are_required_and_what_presets_serve(cache, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("field aspect_ratio"))
    assert "REQUIRED for t2va" in line and "--extra aspect_ratio" in line, line
    assert any("preset tiny:minimax-h3-ref2va" in ln and "[serves ref2va]" in ln for ln in out.splitlines())
