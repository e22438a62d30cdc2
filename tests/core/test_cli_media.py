"""The CLI in a subprocess: ``omnicore generate`` with roles, ``--duration``, ``--quality``, ``--model-option``;
``omnicore models [--json]`` (no torch); ``serve`` refusing a bad model option before it listens.

The toy-media model reaches the subprocess as a real installed-style distribution (a ``.dist-info`` with an
``omnicore`` entry point on ``PYTHONPATH``), so the real plugin loading path runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

TESTS = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "diffusers", "transformers")

ENTRY = """
from omnicore import hookimpl

@hookimpl
def omnicore_register_models(register):
    from toy.media import TOY_MEDIA_SPEC  # the toy package imports torch: only this test plugin does that
    register(TOY_MEDIA_SPEC)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A folder with a fake distribution whose ``omnicore`` entry point registers toy-media."""
    root = tmp_path_factory.mktemp("media-site")
    info = root / "omnitest_toymedia-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: omnitest-toymedia\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[omnicore]\ntoymedia = omnitest_toymedia_entry\n")
    (root / "omnitest_toymedia_entry.py").write_text(ENTRY)
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("media-cli-cache")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from toy.media import write_mp4, write_png, write_wav

    d = tmp_path_factory.mktemp("media-cli-files")
    (d / "notes.txt").write_text("plain text")
    return {"png": write_png(d / "first.png", 40), "mp4": write_mp4(d / "ref.mp4", value=180),
            "wav": write_wav(d / "ref.wav"), "txt": d / "notes.txt"}


def _env(site: Path | None, cache: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    paths = [str(p) for p in (site, TESTS) if p is not None]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if cache is not None:
        env["OMNICORE_CACHE"] = str(cache)
    if site is not None:
        env["OMNICORE_PLUGINS"] = "toymedia"
    env.update(extra)
    return env


def omnicore(site: Path | None, cache: Path | None, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omnicore.cli.main", *args], env=_env(site, cache),
                          check=False, capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------------------------------- generate


@pytest.mark.slow
def test_generate_with_roles_matches_the_python_api(site, cache, files, tmp_path):
    out = tmp_path / "cli.png"
    proc = omnicore(site, cache, "generate", "tiny:toy-media", "a lamp", "-o", str(out), "--seed", "4",
                    "--first-frame", str(files["png"]), "--reference", str(files["mp4"]), "--reference",
                    str(files["wav"]), "--model-option", "conditioning_shift=0.5", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout and "seed 4" in proc.stdout
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.engine.request import MediaInput
    from toy import ToyPlugin, toy_host
    from toy.media import TOY_MEDIA_SPEC

    settings = Settings(cache_dir=str(cache))
    inputs = [MediaInput("image", "first_frame", str(files["png"])), MediaInput("video", "reference", str(files["mp4"])),
              MediaInput("audio", "reference", str(files["wav"]))]
    host = toy_host(settings, plugin=ToyPlugin(TOY_MEDIA_SPEC))
    with Engine("tiny:toy-media", host=host, settings=settings, model_options={"conditioning_shift": 0.5}) as e:
        [same] = e.generate("a lamp", seed=4, inputs=inputs)
        [unshifted] = e.generate("a lamp", seed=4, inputs=inputs[:1])
    png = np.asarray(Image.open(out).convert("RGB"))
    assert np.array_equal(png, same.frames[0])
    assert not np.array_equal(png, unshifted.frames[0])


@pytest.fixture
def cli(monkeypatch, cache):
    """In-process ``main([...])`` with the toy-media model on an isolated host (fast: no interpreter start)."""
    from omnicore.cli import generate_cmd, models_cmd
    from omnicore.config import Settings
    from toy import ToyPlugin, toy_host
    from toy.media import TOY_MEDIA_SPEC

    monkeypatch.setenv("OMNICORE_CACHE", str(cache))
    monkeypatch.setattr(generate_cmd, "make_host", lambda s: toy_host(s, plugin=ToyPlugin(TOY_MEDIA_SPEC)))
    monkeypatch.setattr(models_cmd, "make_host",
                        lambda: toy_host(Settings(), plugin=ToyPlugin(TOY_MEDIA_SPEC)))
    from omnicore.cli.main import main

    return main


def test_generate_duration_quality_and_preset_defaults(cli, capsys, tmp_path):
    assert cli(["generate", "tiny:toy-media", "waves", "-o", str(tmp_path / "clip.mp4"), "--duration", "0.5",
                "--quality", "draft"]) == 0
    out, err = capsys.readouterr()
    # the preset's defaults: 16x16, 2 steps (draft halves them: 1), seed 1234; 0.5 s at 8 fps = 4 frames
    assert "video 16x16, 4 frames at 8 fps, seed 1234" in out
    assert "step 1/1" in err and "step 2/2" not in err
    assert cli(["generate", "tiny:toy-media", "waves", "-o", str(tmp_path / "std.png")]) == 0
    out, err = capsys.readouterr()
    assert "step 2/2" in err and "image 16x16" in out


@pytest.mark.parametrize(("args", "words"), [
    (["--model-option", "variant=huge"], "error: model_options.variant: must be one of 'base', 'large', got 'huge'"),
    (["--model-option", "nope=1"], ("error: model_options.nope: model toy-media has no option 'nope'; its options: "
                                    "conditioning_shift, revise_prompt, variant")),
    (["--model-option", "conditioning_shift=lots"], "error: model_options.conditioning_shift: must be of type float"),
    (["--model-option", "novalue"], "error: --model-option: expected KEY=VALUE"),
    (["--reference", "{txt}"], "error: --reference[0]: not a recognised image"),
    (["--first-frame", "{mp4}"], "error: --first-frame: "),
    (["--first-frame", "{missing}"], "error: --first-frame: cannot read"),
    (["--reference", "{png}"] * 4, "error: --reference {png}: model toy-media takes at most 3 reference input(s)"),
])
def test_generate_errors_are_one_line_with_exit_2(cli, capsys, files, tmp_path, args, words):
    args = [a.format(txt=files["txt"], mp4=files["mp4"], png=files["png"], missing=tmp_path / "missing.png")
            for a in args]
    words = words.format(png=files["png"])
    assert cli(["generate", "tiny:toy-media", "x", "-o", str(tmp_path / "o.png"), *args]) == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(words), lines
    assert not (tmp_path / "o.png").exists()


@pytest.mark.slow
def test_generate_rejects_a_role_the_model_lacks_before_loading(cache, files, tmp_path):
    """tiny:lingbot (the real plugin, in a subprocess) takes a first frame only: a last frame is refused
    before the preset is built or loaded."""
    pytest.importorskip("omni_lingbot")
    fresh = tmp_path / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "omnicore.cli.main", "generate", "tiny:lingbot", "x", "-o", str(tmp_path / "o.mp4"),
         "--last-frame", str(files["png"])], env=_env(None, fresh, OMNICORE_PLUGINS="lingbot"),
        check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert f"error: --last-frame {files['png']}: model lingbot does not accept role 'last_frame'; it accepts: " \
           "first_frame" in proc.stderr  # the flag, not the engine's inputs[0].role
    assert not (fresh / "presets").exists()  # nothing was built


def test_quality_flag_is_checked_by_the_parser(cli, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        cli(["generate", "tiny:toy", "x", "-o", str(tmp_path / "o.png"), "--quality", "ultra"])
    assert info.value.code == 2 and "invalid choice: 'ultra'" in capsys.readouterr().err


def test_serve_refuses_a_bad_model_option_before_listening(cli, capsys):
    assert cli(["serve", "tiny:toy-media", "--port", "1", "--model-option", "variant=huge"]) == 2
    err = capsys.readouterr().err
    assert "error: model_options.variant: must be one of 'base', 'large'" in err and "listening" not in err


# ------------------------------------------------------------------------------------------- models


def test_models_json_lists_lingbot_without_importing_torch(cache):
    pytest.importorskip("omni_lingbot")
    probe = ("import contextlib, io, json, sys\n"
             "from omnicore.cli.main import main\n"
             "js, text = io.StringIO(), io.StringIO()\n"
             "with contextlib.redirect_stdout(js):\n"
             "    assert main(['models', '--json']) == 0\n"
             "with contextlib.redirect_stdout(text):\n"
             "    assert main(['models']) == 0\n"
             "print(json.dumps({'json': js.getvalue(), 'text': text.getvalue(), 'mods': sorted(sys.modules)}))\n")
    proc = subprocess.run([sys.executable, "-c", probe], env=_env(None, cache, OMNICORE_PLUGINS="lingbot"),
                          check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.splitlines()[-1])
    assert "omnicore.cli.models_cmd" in result["mods"]
    assert [m for m in result["mods"] if m.split(".")[0] in HEAVY] == []
    payload = json.loads(result["json"])
    [card] = [m for m in payload["models"] if m["name"] == "lingbot"]
    assert card["modes"] == ["t2i", "t2v", "ti2v"] and card["outputs"] == ["image", "video"]
    assert [(r["role"], r["kinds"], r["max_count"]) for r in card["inputs"]] == [("first_frame", ["image"], 1)]
    presets = {p["name"]: p for p in card["presets"]}
    assert set(presets) == {"tiny:lingbot", "tiny:lingbot-moe"}
    tiny = presets["tiny:lingbot"]["defaults"]
    assert (tiny["height"], tiny["width"], tiny["num_frames"], tiny["num_inference_steps"]) == (48, 48, 5, 4)
    assert card["defaults"]["height"] == 480 and card["defaults"]["num_frames"] == 81
    assert card["limits"]["size_multiple_of"] == 16 and card["limits"]["frame_rule"] == "4n+1"
    assert isinstance(card["options"], list)
    assert "preset tiny:lingbot: " in result["text"] and "inputs: first_frame (image, max 1)" in result["text"]


def test_models_text_lists_options_with_choices_and_preset_defaults(cli, capsys):
    assert cli(["models"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("toy-media  (toy)")
    assert "inputs: reference (image/video/audio, max 3); first_frame (image, max 1); last_frame (image, max 1) " \
           "(at most 4 in total)" in text
    assert "preset tiny:toy-media: toy with media roles [defaults: 16x16, 2 steps, guidance 1, seed 1234]" in text
    assert "option variant (str, one of base, large; default 'base'): recorded only" in text
    assert "option conditioning_shift (float, default 0.0)" in text


def test_plugins_lists_presets_with_their_defaults(cache):
    pytest.importorskip("omni_lingbot")
    env = _env(None, cache, OMNICORE_PLUGINS="lingbot")
    proc = subprocess.run([sys.executable, "-m", "omnicore.cli.main", "plugins", "--json"], env=env,
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    presets = {p["name"]: p for p in json.loads(proc.stdout)["presets"]}
    assert set(presets) == {"tiny:lingbot", "tiny:lingbot-moe"}
    assert presets["tiny:lingbot"]["model"] == "lingbot" and presets["tiny:lingbot"]["defaults"]["height"] == 48
    table = subprocess.run([sys.executable, "-m", "omnicore.cli.main", "plugins"], env=env, check=False, capture_output=True,
                           text=True, timeout=60).stdout
    assert "model: lingbot (presets tiny:lingbot, tiny:lingbot-moe)" in table
