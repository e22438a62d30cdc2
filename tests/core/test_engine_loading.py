"""Model resolution: tiny presets (build once, atomic, rebuilt when the builder changes), local directories,
Hugging Face repo ids (offline here), unknown names."""

from __future__ import annotations

import json
import os
import sys

import attrs
import numpy as np
import pytest
import torch
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.engine.loading import MARKER, detect_spec, resolve_model
from omnicore.errors import InvalidRequest, PluginError, UnknownName
from omnicore.specs import PresetSpec
from safetensors.torch import load_file


def test_tiny_preset_is_built_once_into_the_cache(toy_host, toy_settings):
    first = resolve_model("tiny:toy", toy_host, toy_settings)
    assert first.source == "preset" and first.spec.name == "toy" and first.spec.provider == "toy"
    assert first.path == toy_settings.cache_path / "presets" / "toy"
    assert {p.name for p in first.path.iterdir()} == {"config.json", "model.safetensors", MARKER}
    stamp = (first.path / "model.safetensors").stat().st_mtime_ns
    second = resolve_model("TINY:toy", toy_host, toy_settings)
    assert second.path == first.path and (first.path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in first.path.parent.iterdir()] == ["toy"]  # no temp dirs left behind


def _builder_module(make_module, weight_seed: int, name: str | None = None) -> str:
    source = f"""
        from toy import build_toy_checkpoint
        def build(target):
            build_toy_checkpoint(target, weight_seed={weight_seed})
    """
    if name is None:
        return make_module(source, prefix="toy_builder")
    import importlib
    import pathlib
    import textwrap

    path = pathlib.Path(sys.modules[name].__file__)
    path.write_text(textwrap.dedent(source))
    sys.modules.pop(name)
    importlib.invalidate_caches()
    return name


def test_changed_builder_rebuilds_the_preset(make_module, tmp_path):
    from toy import TOY_SPEC, ToyPlugin, toy_host

    module = _builder_module(make_module, weight_seed=1)
    spec = attrs.evolve(TOY_SPEC, presets=(PresetSpec(name="toy", builder=f"{module}:build"),))
    settings = Settings(cache_dir=str(tmp_path))
    host = toy_host(settings, plugin=ToyPlugin(spec))
    path = resolve_model("tiny:toy", host, settings).path
    before = load_file(str(path / "model.safetensors"))["conv_in.weight"].clone()
    assert torch.equal(load_file(str(resolve_model("tiny:toy", host, settings).path / "model.safetensors"))
                       ["conv_in.weight"], before)
    _builder_module(make_module, weight_seed=2, name=module)  # edit the builder's source
    after = load_file(str(resolve_model("tiny:toy", host, settings).path / "model.safetensors"))["conv_in.weight"]
    assert not torch.equal(after, before)
    assert [p.name for p in path.parent.iterdir()] == ["toy"]


def test_failing_builder_leaves_nothing(make_module, tmp_path):
    from toy import TOY_SPEC, ToyPlugin, toy_host

    module = make_module("""
        def build(target):
            (target / "config.json").write_text("{}")
            raise OSError("disk full")
    """)
    spec = attrs.evolve(TOY_SPEC, presets=(PresetSpec(name="toy", builder=f"{module}:build"),))
    settings = Settings(cache_dir=str(tmp_path))
    with pytest.raises(PluginError, match="building preset 'tiny:toy' failed: disk full") as info:
        resolve_model("tiny:toy", toy_host(settings, plugin=ToyPlugin(spec)), settings)
    assert info.value.plugin == "toy"
    assert list((tmp_path / "presets").iterdir()) == []


def test_local_directory_is_detected_and_loads(toy_host, toy_settings, tmp_path):
    from toy import ToyConfig, build_toy_checkpoint

    ckpt = build_toy_checkpoint(tmp_path / "ckpt", ToyConfig(work=32, hidden=8))
    resolved = resolve_model(str(ckpt), toy_host, toy_settings)
    assert resolved.source == "local" and resolved.spec.name == "toy"
    with Engine(str(ckpt), host=toy_host, settings=toy_settings) as engine:
        assert engine.pipeline.model.cfg.work == 32
        [out] = engine.generate("x", seed=0)
        assert out.frames.shape == (1, 32, 32, 3)


@pytest.mark.parametrize("layout", ["config_architectures", "model_index_class_name"])
def test_local_directory_matched_by_declared_class_name(toy_host, tmp_path, layout):
    from toy import build_toy_checkpoint

    ckpt = build_toy_checkpoint(tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.pop("model_type")  # the spec's detect() no longer recognises it
    if layout == "model_index_class_name":
        cfg.pop("architectures")
        (ckpt / "model_index.json").write_text(json.dumps({"_class_name": "ToyDiT"}))
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert detect_spec(toy_host, ckpt).name == "toy"


def test_unrecognised_directory_names_what_it_saw(toy_host, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["SomethingElse"]}))
    with pytest.raises(InvalidRequest, match="SomethingElse.*known models: toy") as info:
        detect_spec(toy_host, tmp_path)
    assert info.value.field == "model"


@pytest.mark.parametrize("name", ["tiny:nope", "not-a-model", "./missing/dir/x"])
def test_unknown_model_lists_models_and_presets(toy_host, toy_settings, name):
    with pytest.raises(UnknownName) as info:
        resolve_model(name, toy_host, toy_settings)
    assert "tiny:toy" in info.value.known and "toy" in info.value.known
    assert "tiny:toy (from toy)" in str(info.value)


def test_hub_repo_id_offline_gives_a_clear_error(toy_host, toy_settings, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(InvalidRequest, match="could not download Hugging Face repo 'someone/some-model'") as info:
        resolve_model("someone/some-model", toy_host, toy_settings)
    assert info.value.field == "model"


def test_engine_options_are_validated_before_loading(toy_host, toy_settings):
    with pytest.raises(InvalidRequest) as info:
        Engine("tiny:toy", host=toy_host, settings=toy_settings, offload="disk")
    assert info.value.field == "offload"
    with pytest.raises(UnknownName):
        Engine("tiny:toy", host=toy_host, settings=toy_settings, cache_methods=["no_such_cache"])
    assert not (toy_settings.cache_path / "presets").exists()


def test_explicit_platform_by_name(toy_host, toy_settings):
    with Engine("tiny:toy", host=toy_host, settings=toy_settings, platform="cpu") as engine:
        assert engine.platform.name == "cpu"
        assert engine.pipeline.options.platform is engine.platform
        assert callable(engine.pipeline.options.attention)
        [a] = engine.generate("x", seed=5)
    with Engine("tiny:toy", host=toy_host, settings=toy_settings) as engine:
        [b] = engine.generate("x", seed=5)
    assert np.array_equal(a.frames, b.frames)


def test_a_change_anywhere_in_the_builders_package_rebuilds_the_preset(tmp_path, monkeypatch):
    """The fingerprint covers the builder's whole package (e.g. the model's layer definitions), not one file."""
    from omnicore.engine.loading import builder_fingerprint

    pkg = tmp_path / "src" / "fp_pkg_demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "presets.py").write_text("def build(target):\n    pass\n")
    (pkg / "layers.py").write_text("WIDTH = 4\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    preset = PresetSpec(name="demo", builder="fp_pkg_demo.presets:build")
    first = builder_fingerprint(preset)
    assert builder_fingerprint(preset) == first
    (pkg / "layers.py").write_text("WIDTH = 8\n")  # not the builder's module, same package
    assert builder_fingerprint(preset) != first


_RACE_CHILD = """
import sys, time
from pathlib import Path
from omnicore.engine.loading import ensure_preset
from omnicore.specs import ModelSpec, PresetSpec

start, cache = float(sys.argv[1]), Path(sys.argv[2])
preset = PresetSpec(name="racer", builder=sys.argv[3] + ":build")
time.sleep(max(0.0, start - time.time()))  # every process asks at the same moment
built = ensure_preset(ModelSpec(name="racer", impl="x.y:Z", presets=(preset,)), preset, cache)
print(sorted(p.name for p in built.iterdir()))
"""


def test_processes_asking_at_once_build_the_preset_once_and_each_finds_it_whole(make_module, tmp_path):
    """Replicas started together on one cache: one process builds (slowly, here) while the others wait, and none
    sees a half-written or replaced build (before, each built its own copy and swapped it in under the others)."""
    import subprocess
    import time

    count = tmp_path / "builds"
    module = make_module(f"""
        import time
        from pathlib import Path

        def build(target):
            with open({str(count)!r}, "a") as f:
                f.write("x")
            (target / "a.json").write_text("1")
            time.sleep(0.5)
            (target / "b.json").write_text("2")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "_modules"),
                                                         os.environ.get("PYTHONPATH", "")])}
    start = time.time() + 3.0
    procs = [subprocess.Popen([sys.executable, "-c", _RACE_CHILD, str(start), str(tmp_path / "cache"), module],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    assert all(out.strip().endswith("['.omnicore-preset.json', 'a.json', 'b.json']") for out, _ in outs), outs
    assert count.read_text() == "x"  # built once
