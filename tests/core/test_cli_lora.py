"""LoRA on the command line (issue 22): ``generate --lora NAME_OR_PATH[:SCALE]`` (repeatable, a path-safe parse),
``serve --lora-modules/--lora-dir/--max-lora-bytes`` (checked before anything binds) and ``omnicore models
--lora-modules`` — with the toy model (its MLP linears take adapters) on an isolated host. Toy outputs are noise:
the checks are equalities with the Python API and refusals naming the flag.
"""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest
from _lora_files import TOY_LINEARS, write_kohya, write_peft
from omnicore.cli import generate_cmd
from omnicore.cli.lora_args import describe_adapter, parse_lora_flags, serve_lora_kwargs
from omnicore.cli.main import main
from omnicore.config import Settings, resolve_settings
from omnicore.engine.api import Engine
from omnicore.errors import ConfigError, InvalidRequest
from omnicore.lora import AdapterRegistry, LoRA, LoRATargets
from PIL import Image
from toy import TOY_SPEC, ToyPlugin, toy_host

LORA_TOY = attrs.evolve(TOY_SPEC, lora=LoRATargets(modules=("mlp.*", "time_proj"), root="model"))
MLP = {k: v for k, v in TOY_LINEARS.items() if k.startswith("mlp")}


@pytest.fixture
def cli(monkeypatch, tmp_path):
    """The CLI's host: an isolated one with the toy (``state["spec"]``, LoRA-capable by default); records the hosts
    and every Engine built (so a test can tell whether the model was loaded)."""
    monkeypatch.setenv("OMNICORE_CACHE", str(tmp_path / "cache"))
    state: dict = {"spec": LORA_TOY, "hosts": [], "engines": []}

    def make_host(settings):
        state["hosts"].append(toy_host(settings, plugin=ToyPlugin(state["spec"])))
        return state["hosts"][-1]

    real_init = Engine.__init__

    def counting_init(self, *args, **kwargs):
        state["engines"].append(kwargs.get("lora_registry"))
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(generate_cmd, "make_host", make_host)
    monkeypatch.setattr(Engine, "__init__", counting_init)
    return state


@pytest.fixture
def adapters(tmp_path):
    return {"a": write_peft(tmp_path / "a_lora", MLP, rank=4, seed=1),
            "b": write_peft(tmp_path / "b_lora", {"mlp.0": (64, 64), "time_proj": (64, 64)}, rank=8, seed=2),
            "k": write_kohya(tmp_path / "k.safetensors", {"mlp.1": (64, 64)}, rank=2, seed=3),
            "bad": write_peft(tmp_path / "bad_lora", {"mlp.9": (64, 64)}, seed=4)}


def _reference(tmp_path, cli, loras, modules) -> np.ndarray:
    s = Settings(cache_dir=str(tmp_path / "cache"))
    registry = AdapterRegistry(modules={m: m for m in modules})
    with Engine("tiny:toy", host=toy_host(s, plugin=ToyPlugin(LORA_TOY)), settings=s,
                lora_registry=registry) as engine:
        [ref] = engine.generate("a lamp", seed=5, num_inference_steps=2, loras=loras)
    return ref.frames[0]


@pytest.mark.parametrize(("text", "name", "scale"), [
    ("./a_lora", "./a_lora", 1.0),
    ("./b_lora:0.5", "./b_lora", 0.5),
    ("b:-1e-1", "b", -0.1),
    ("C:\\loras\\x.safetensors", "C:\\loras\\x.safetensors", 1.0),  # a Windows drive is not a scale
    ("C:\\loras\\x.safetensors:2", "C:\\loras\\x.safetensors", 2.0),
    ("./odd:name", "./odd:name", 1.0),  # a colon in a path stays in the path
    ("dir/v1.5:0", "dir/v1.5", 0.0),
])
def test_lora_flag_parse_takes_only_a_trailing_number_as_the_scale(text, name, scale):
    [lora] = parse_lora_flags([text])
    assert (lora.name_or_path, lora.scale) == (name, scale)


@pytest.mark.parametrize(("texts", "rule"), [(["a:nan"], "finite"), (["a:1e9"], "between"), ([""], "non-empty"),
                                             (["a"] * 9, "at most 8")])
def test_lora_flag_refusals_name_the_flag(texts, rule):
    with pytest.raises(InvalidRequest) as info:
        parse_lora_flags(texts)
    assert info.value.field == "--lora" and rule in info.value.rule


def test_generate_with_two_adapters_equals_the_python_api(cli, adapters, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the acceptance's relative paths: ./a_lora, ./b_lora:0.5
    out = tmp_path / "x.png"
    assert main(["generate", "tiny:toy", "a lamp", "--lora", "./a_lora", "--lora", "./b_lora:0.5",
                 "--seed", "5", "--steps", "2", "-o", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    got = np.asarray(Image.open(out).convert("RGB"))
    want = _reference(tmp_path, cli, [LoRA("./a_lora"), LoRA("./b_lora", 0.5)], ["./a_lora", "./b_lora"])
    assert np.array_equal(got, want)
    plain = tmp_path / "plain.png"
    assert main(["generate", "tiny:toy", "a lamp", "--seed", "5", "--steps", "2", "-o", str(plain),
                 "--no-progress"]) == 0
    assert not np.array_equal(got, np.asarray(Image.open(plain).convert("RGB")))
    zero = tmp_path / "zero.png"  # scale 0: exactly no adapter
    assert main(["generate", "tiny:toy", "a lamp", "--lora", f"{adapters['k']}:0", "--seed", "5", "--steps", "2",
                 "-o", str(zero), "--no-progress"]) == 0
    assert np.array_equal(np.asarray(Image.open(zero)), np.asarray(Image.open(plain)))


def test_generate_refuses_bad_adapters_before_the_model_loads(cli, adapters, tmp_path, capsys):
    pickled = tmp_path / "weights.bin"
    pickled.write_bytes(b"\x80\x04 not safetensors")
    for lora, text in ((str(tmp_path / "missing"), "no such file or directory"),
                       (str(pickled), "only .safetensors adapters are read"),
                       (f"{adapters['a']}:inf", "finite")):
        rc = main(["generate", "tiny:toy", "x", "--lora", lora, "-o", str(tmp_path / "o.png")])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: --lora: ") and text in err, err
        assert len(err.strip().splitlines()) == 1
    assert cli["engines"] == []  # nothing was loaded
    cli["spec"] = TOY_SPEC  # a model that declares no adaptable modules
    rc = main(["generate", "tiny:toy", "x", "--lora", str(adapters["a"]), "-o", str(tmp_path / "o.png")])
    assert rc == 2 and "error: --lora: model toy does not take LoRA adapters" in capsys.readouterr().err
    assert cli["engines"] == []


def test_generate_reports_a_model_mismatch_under_the_flag(cli, adapters, tmp_path, capsys):
    """An adapter whose module the model lacks is known only once the model is loaded: still one line, --lora."""
    rc = main(["generate", "tiny:toy", "x", "--lora", str(adapters["bad"]), "-o", str(tmp_path / "o.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --lora: ") and "mlp.9" in err, err
    assert len(cli["engines"]) == 1


@pytest.mark.parametrize(("kind", "text"), [
    ("shape", "shape mismatch for 'mlp.0' (64 -> 64)"),
    ("rank", "rank mismatch for 'mlp.0': the config says r=8, the weights have rank 4"),
    ("unknown", "'base_model.model.mlp.0.lora_magnitude_vector': unknown key"),
])
def test_generate_refuses_a_broken_adapter_in_one_line_under_the_flag(cli, tmp_path, capsys, kind, text):
    """A shape, a rank or a key that does not fit: one line naming the adapter and the key, exit 2, nothing run."""
    import torch

    broken = {"shape": lambda p: write_peft(p, {"mlp.0": (32, 64)}, seed=7),
              "rank": lambda p: write_peft(p, MLP, rank=4, config_rank=8, seed=8),
              "unknown": lambda p: write_peft(p, MLP, seed=9, extra={
                  "base_model.model.mlp.0.lora_magnitude_vector": torch.ones(64)})}[kind](tmp_path / f"{kind}_lora")
    rc = main(["generate", "tiny:toy", "x", "--lora", str(broken), "-o", str(tmp_path / "o.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: --lora: ") and text in err and f"{kind}_lora" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "o.png").exists()


def test_compile_with_adapters_is_refused_on_the_command_line_before_loading(cli, adapters, tmp_path, capsys,
                                                                            monkeypatch):
    """``--compile`` with ``--lora`` (generate) or ``--lora-modules`` / ``--lora-dir`` (serve): one line naming
    --compile and why, exit 2, and no weights read (the refusal comes before the load)."""
    from toy.pipeline import ToyPipeline

    loads = []
    real = ToyPipeline.from_pretrained.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(ToyPipeline, "from_pretrained",
                        classmethod(lambda cls, *a, **k: loads.append(1) or real(cls, *a, **k)))
    rc = main(["generate", "tiny:toy", "x", "--compile", "blocks", "--lora", str(adapters["a"]),
               "-o", str(tmp_path / "o.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: compile: ") and "cannot be combined with LoRA adapters" in err, err
    for flags in (["--lora-modules", f"a={adapters['a']}"], ["--lora-dir", str(tmp_path)]):
        rc = main(["serve", "tiny:toy", "--port", "0", "--compile", "blocks", *flags])
        err = capsys.readouterr().err
        assert rc == 2 and "cannot be combined with LoRA adapters" in err, (flags, err)
    assert len(cli["engines"]) == 3 and loads == []  # three Engine() calls, each refused before its load
    assert main(["generate", "tiny:toy", "x", "--lora", str(adapters["a"]), "-o", str(tmp_path / "o.png")]) == 0
    assert loads == [1]  # (the counter sees a load when there is one)


def test_serve_lora_settings_build_the_registry_and_refuse_before_binding(cli, adapters, tmp_path, capsys):
    settings = resolve_settings({"lora_modules": [f"a={adapters['a']}", f"k={adapters['k']}"],
                                 "lora_dirs": [str(tmp_path)], "max_lora_bytes": "1MiB"}, env={})
    registry = serve_lora_kwargs(settings, LORA_TOY)["lora_registry"]
    assert registry.list_modules() == ["a", "k"] and registry.max_device_bytes == 1024**2
    assert registry.lora_dirs == (tmp_path.resolve(),)
    assert serve_lora_kwargs(resolve_settings(env={})) == {}  # no adapter settings: the engine's empty default
    with pytest.raises(ConfigError, match="^--lora-modules: model toy does not take LoRA adapters"):
        serve_lora_kwargs(settings, TOY_SPEC)
    cases = [(["--lora-modules", f"a={tmp_path / 'missing'}"], "error: --lora-modules: adapter 'a': "),
             (["--lora-dir", str(tmp_path / "nodir")], "error: --lora-dir: "),
             (["--lora-modules", "noequals"], "error: --lora-modules: expected NAME=PATH"),
             (["--lora-modules", f"a={adapters['a']}", "--lora-modules", f"a={adapters['b']}"], "given twice")]
    for flags, text in cases:
        rc = main(["serve", "tiny:toy", "--port", "0", *flags])
        err = capsys.readouterr().err
        assert rc == 2 and text in err, (flags, err)
    with pytest.raises(SystemExit):  # argparse's usage error, naming the flag
        main(["serve", "tiny:toy", "--max-lora-bytes", "lots"])
    assert "--max-lora-bytes" in capsys.readouterr().err
    cli["spec"] = TOY_SPEC
    assert main(["serve", "tiny:toy", "--port", "0", "--lora-modules", f"a={adapters['a']}"]) == 2
    assert "does not take LoRA adapters" in capsys.readouterr().err
    assert cli["engines"] == []


def test_lora_settings_from_the_environment(tmp_path, adapters):
    env = {"OMNICORE_LORA_MODULES": f"a={adapters['a']},k={adapters['k']}", "OMNICORE_LORA_DIRS": str(tmp_path),
           "OMNICORE_MAX_LORA_BYTES": "2GB"}
    s = resolve_settings(env=env)
    assert s.lora_modules == (("a", str(adapters["a"])), ("k", str(adapters["k"])))
    assert s.lora_dirs == (str(tmp_path),) and s.max_lora_bytes == 2 * 1000**3
    with pytest.raises(ConfigError, match="^OMNICORE_MAX_LORA_BYTES: "):
        resolve_settings(env={"OMNICORE_MAX_LORA_BYTES": "-5"})


def test_the_host_budget_reaches_the_registry(tmp_path):
    """``--max-lora-host-bytes`` / ``OMNICORE_MAX_LORA_HOST_BYTES`` bound the converted adapters in host memory."""
    settings = resolve_settings({"lora_dirs": [str(tmp_path)], "max_lora_host_bytes": "3MiB"}, env={})
    assert serve_lora_kwargs(settings)["lora_registry"].max_host_bytes == 3 * 1024**2
    s = resolve_settings(env={"OMNICORE_LORA_DIRS": str(tmp_path), "OMNICORE_MAX_LORA_HOST_BYTES": "1GB"})
    assert serve_lora_kwargs(s)["lora_registry"].max_host_bytes == 1000**3
    with pytest.raises(ConfigError, match="^OMNICORE_MAX_LORA_HOST_BYTES: "):
        resolve_settings(env={"OMNICORE_MAX_LORA_HOST_BYTES": "lots"})


def test_models_lists_adapters_and_each_models_targets(cli, adapters, tmp_path, capsys, monkeypatch):
    from omnicore.cli import models_cmd

    monkeypatch.setattr(models_cmd, "make_host", lambda: toy_host(Settings(), plugin=ToyPlugin(LORA_TOY)))
    assert main(["models", "--json", "--lora-modules", f"a={adapters['a']}", "--lora-modules",
                 f"k={adapters['k']}"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["models"][0]["lora"] == {"root": "model", "modules": ["mlp.*", "time_proj"], "adaln": []}
    loras = {x["name"]: x for x in data["loras"]}
    assert (loras["a"]["layout"], loras["a"]["rank"], loras["a"]["modules"]) == ("peft", 4, 2)
    assert (loras["k"]["layout"], loras["k"]["rank"], loras["k"]["modules"]) == ("kohya", 2, 1)
    monkeypatch.setenv("OMNICORE_LORA_MODULES", f"a={adapters['a']}")
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert f"lora a: {adapters['a']} (peft, rank 4, 2 modules, trained on tiny:toy)" in text
    assert "lora: adapters may target model.{mlp.*, time_proj}" in text


def test_describe_adapter_reads_headers_only_and_reports_unreadable_files(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 16)
    assert "error" in describe_adapter("j", str(junk))
    assert "error" in describe_adapter("m", str(tmp_path / "missing"))
