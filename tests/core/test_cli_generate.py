"""``omnicore generate`` and ``omnicore serve auto`` resolution, with the toy model on an isolated host."""

from __future__ import annotations

import numpy as np
import pytest
from omnicore.cli import generate_cmd, serve_cmd
from omnicore.cli.main import main
from omnicore.config import Settings
from omnicore.engine.api import Engine
from PIL import Image


@pytest.fixture
def cli_host(monkeypatch, tmp_path):
    """Route the CLI's host to an isolated one with the toy plugin, caching under tmp_path."""
    from toy import toy_host

    monkeypatch.setenv("OMNICORE_CACHE", str(tmp_path / "cache"))
    hosts = []

    def make_host(settings):
        from toy import TOY_ADALN_SPEC, ToyPlugin

        hosts.append(toy_host(settings))
        hosts[-1].add_plugin(ToyPlugin(TOY_ADALN_SPEC), "toy-adaln")
        return hosts[-1]

    monkeypatch.setattr(generate_cmd, "make_host", make_host)
    return hosts


def test_generate_png_matches_the_engine(cli_host, tmp_path, capsys):
    out = tmp_path / "out.png"
    rc = main(["generate", "tiny:toy", "a tiny red house", "-o", str(out), "--seed", "5", "--steps", "3",
               "--height", "48", "--width", "32"])
    assert rc == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out and "seed 5" in captured.out
    assert "denoise step 3/3" in captured.err and "[100%] done" in captured.err
    png = np.asarray(Image.open(out).convert("RGB"))
    with Engine("tiny:toy", host=cli_host[0], settings=Settings(cache_dir=str(tmp_path / "cache"))) as engine:
        [ref] = engine.generate("a tiny red house", seed=5, num_inference_steps=3, height=48, width=32)
    assert np.array_equal(png, ref.frames[0])


def test_generate_mp4_with_extra_and_no_progress(cli_host, tmp_path, capsys):
    import av

    out = tmp_path / "clip.mp4"
    rc = main(["generate", "tiny:toy", "waves", "-o", str(out), "--num-frames", "4", "--fps", "8", "--seed", "1",
               "--extra", "tag=\"x\"", "--no-progress"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "4 frames at 8 fps" in captured.out and captured.err == ""
    with av.open(str(out)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 4


def test_generate_reports_errors_with_exit_code_2(cli_host, tmp_path, capsys):
    rc = main(["generate", "tiny:toy", "x", "-o", str(tmp_path / "a.png"), "--height", "36"])
    assert rc == 2
    # named by its flag, with the nearest valid sizes, before any load (the engine's name was params.height)
    assert "error: --height: 36 is not a multiple of 8" in capsys.readouterr().err
    rc = main(["generate", "tiny:missing", "x", "-o", str(tmp_path / "a.png")])
    assert rc == 2
    assert "tiny:toy" in capsys.readouterr().err
    assert main(["generate", "tiny:toy", "x", "-o", str(tmp_path / "a.png"), "--extra", "novalue"]) == 2


def test_parse_extra():
    assert generate_cmd.parse_extra(["a=1", "b=true", "c=hello", 'd={"x": [1]}']) == {
        "a": 1, "b": True, "c": "hello", "d": {"x": [1]}}


def test_serve_auto_without_model_plugin_exits_2(monkeypatch, tmp_path, capsys):
    from omnicore.plugin_host.host import PluginHost

    monkeypatch.setattr(generate_cmd, "make_host", lambda s: PluginHost(s, autoload=False))
    assert main(["serve", "auto"]) == 2
    err = capsys.readouterr().err
    assert "no model plugin is installed" in err and "pip install -e plugins/lingbot" in err


def test_serve_auto_prefers_lingbot_then_first_preset(toy_host):
    import attrs
    from toy import TOY_SPEC, ToyPlugin

    assert serve_cmd.resolve_auto(toy_host) == "tiny:toy"
    lingbot = attrs.evolve(TOY_SPEC, name="lingbot", aliases=(), detect=None,
                           presets=(attrs.evolve(TOY_SPEC.presets[0], name="lingbot"),))
    toy_host.add_plugin(ToyPlugin(lingbot), "lingbot")
    assert serve_cmd.resolve_auto(toy_host) == "tiny:lingbot"


def test_generate_with_reference_image_offload_and_cache_flags(cli_host, tmp_path, capsys):
    ref_path = tmp_path / "ref.png"
    Image.new("RGB", (24, 16), (200, 40, 90)).save(ref_path)
    out = tmp_path / "edit.png"
    rc = main(["generate", "tiny:toy-adaln", "a lamp", "--image", str(ref_path), "-o", str(out), "--seed", "9",
               "--steps", "3", "--offload", "layerwise", "--cache", "adaln_schedule", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    png = np.asarray(Image.open(out).convert("RGB"))
    with Engine("tiny:toy-adaln", host=cli_host[0], settings=Settings(cache_dir=str(tmp_path / "cache"))) as engine:
        [ref] = engine.generate("a lamp", images=[str(ref_path)], seed=9, num_inference_steps=3)
        [plain] = engine.generate("a lamp", seed=9, num_inference_steps=3)
    assert np.array_equal(png, ref.frames[0])  # offload + exact cache change nothing
    assert not np.array_equal(png, plain.frames[0])  # the reference image was used


def test_unsupported_output_suffix_fails_before_loading(cli_host, tmp_path, capsys):
    rc = main(["generate", "tiny:toy", "x", "-o", str(tmp_path / "out.gif")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "output" in err and ".png" in err and ".mp4" in err
    assert cli_host == []  # no host was made, nothing was loaded
    assert not (tmp_path / "out.gif").exists()


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "-1"])
def test_request_batch_max_wait_flag_rejects_non_finite_and_negative(bad, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "tiny:toy", "x", "-o", "a.png", "--request-batch-max-wait-ms", bad])
    assert info.value.code == 2
    assert "--request-batch-max-wait-ms" in capsys.readouterr().err


def test_request_batch_max_wait_flag_is_a_float_in_the_settings():
    from omnicore.cli.main import build_parser

    args = build_parser().parse_args(["generate", "tiny:toy", "x", "-o", "a.png", "--request-batch-max-wait-ms", "250"])
    assert args.request_batch_max_wait_ms == 250.0 and type(args.request_batch_max_wait_ms) is float
    assert generate_cmd.settings_from_args(args).request_batch_max_wait_ms == 250.0


@pytest.mark.parametrize("text, expected", [
    ("teacache", "teacache"),
    ("teacache:rel_l1_thresh=0.3", ("teacache", {"rel_l1_thresh": 0.3})),
    ("adaln_schedule:offload_weights=true", ("adaln_schedule", {"offload_weights": True})),
    ("teacache:force_hits=[2,3],warmup_steps=1", ("teacache", {"force_hits": [2, 3], "warmup_steps": 1})),
    ("x:label=plain text", ("x", {"label": "plain text"})),
])
def test_cache_flag_parses_method_options(text, expected):
    from omnicore.cli.main import parse_cache_arg

    assert parse_cache_arg(text) == expected


@pytest.mark.parametrize("bad", [":a=1", "teacache:novalue", "teacache:=3"])
def test_malformed_cache_flag_is_an_argparse_error(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "tiny:toy", "x", "-o", "out.png", "--cache", bad])
    assert exc.value.code == 2
    assert "--cache" in capsys.readouterr().err


def test_cache_options_reach_the_method(cli_host, tmp_path, capsys):
    """AdaLN weight offload switched on from the command line still gives the exact bytes; an unknown option
    is a clear error naming the method."""
    out = tmp_path / "adaln.png"
    rc = main(["generate", "tiny:toy-adaln", "a lamp", "-o", str(out), "--seed", "4", "--steps", "3",
               "--cache", "adaln_schedule:offload_weights=true", "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    with Engine("tiny:toy-adaln", host=cli_host[0], settings=Settings(cache_dir=str(tmp_path / "cache"))) as engine:
        [ref] = engine.generate("a lamp", seed=4, num_inference_steps=3)
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), ref.frames[0])
    rc = main(["generate", "tiny:toy-adaln", "a lamp", "-o", str(tmp_path / "bad.png"), "--steps", "2",
               "--cache", "adaln_schedule:no_such_option=1", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "adaln_schedule" in err and "no_such_option" in err


def test_generate_checks_the_request_and_the_model_options_once(cli_host, tmp_path, monkeypatch, capsys):
    """The CLI checks the request before loading and the engine takes it as checked; the model options are the
    engine's alone to resolve (each ran twice on this path before)."""
    from omnicore.engine import api, inputs, loading

    calls: dict[str, int] = {"check_request": 0, "resolve_model_options": 0}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(inputs, "check_request", counting("check_request", inputs.check_request))
    monkeypatch.setattr(api, "check_request", inputs.check_request)
    import omnicore.engine.model_options as model_options

    wrapped = counting("resolve_model_options", model_options.resolve_model_options)
    monkeypatch.setattr(model_options, "resolve_model_options", wrapped)
    monkeypatch.setattr(loading, "resolve_model_options", wrapped)
    monkeypatch.setattr(api, "resolve_model_options", wrapped, raising=False)
    out = tmp_path / "out.png"
    argv = ["generate", "tiny:toy", "a house", "-o", str(out), "--seed", "1", "--steps", "2", "--no-progress"]
    assert main(argv) == 0
    assert calls == {"check_request": 1, "resolve_model_options": 1}


def test_a_checked_request_for_another_spec_is_checked_again(tmp_path):
    """``CheckedRequest`` skips the engine's check only for the spec the engine serves."""
    import attrs
    from omnicore.engine.inputs import CheckedRequest
    from omnicore.engine.request import GenerationRequest, MediaInput, SamplingParams
    from omnicore.errors import InvalidRequest
    from toy import toy_host

    settings = Settings(cache_dir=str(tmp_path / "cache"))
    with Engine("tiny:toy", host=toy_host(settings), settings=settings) as engine:
        roomy = attrs.evolve(engine.spec, name="other")  # checked against some other spec: not this engine's
        bad = GenerationRequest("x", params=SamplingParams(num_inference_steps=1),
                                inputs=(MediaInput("audio", "nonsense", b""),))
        with pytest.raises(InvalidRequest, match="does not accept role 'nonsense'"):
            engine.submit(CheckedRequest(bad, roomy))
