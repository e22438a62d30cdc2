"""omnicore.checkpoint: reading safetensors folders (single file, sharded, prefixes) and strict loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from omnicore.checkpoint import (
    CheckpointError,
    WeightMismatch,
    load_strict,
    read_json,
    read_state_dict,
    weight_files,
)
from omnicore.errors import PluginError
from safetensors.torch import save_file

NAME = "diffusion_pytorch_model.safetensors"


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))


def _write_sharded(folder: Path, state: dict[str, torch.Tensor], name: str = NAME) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    stem = name.removesuffix(".safetensors")
    shards = {f"{stem}-00001-of-00002.safetensors": names[::2], f"{stem}-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / fname))
        weight_map.update({k: fname for k in keys})
    (folder / f"{name}.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_errors_are_plugin_errors_naming_plugin_component_and_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        read_json(tmp_path / "config.json", plugin="demo", component="transformer")
    err = info.value
    assert isinstance(err, PluginError)
    assert (err.plugin, err.component, err.path) == ("demo", "transformer", tmp_path)
    assert "missing config.json" in str(err) and "transformer" in str(err) and str(tmp_path) in str(err)
    assert str(err).startswith("plugin 'demo'")


def test_read_json_rejects_bad_json_and_non_objects(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("{not json")
    (tmp_path / "b.json").write_text("[1, 2]")
    (tmp_path / "c.json").write_text('{"x": 1}')
    with pytest.raises(CheckpointError, match="a.json is not valid JSON"):
        read_json(tmp_path / "a.json", plugin="demo")
    with pytest.raises(CheckpointError, match="b.json holds a list"):
        read_json(tmp_path / "b.json", plugin="demo")
    assert read_json(tmp_path / "c.json", plugin="demo") == {"x": 1}


def test_single_file_and_sharded_folders_read_the_same_state(tmp_path: Path) -> None:
    state = {k: v.clone() for k, v in _tiny().state_dict().items()}
    (tmp_path / "one").mkdir()
    save_file(state, str(tmp_path / "one" / NAME))
    _write_sharded(tmp_path / "two", state)
    assert weight_files(tmp_path / "one", plugin="demo", weights_name=NAME) == [tmp_path / "one" / NAME]
    assert len(weight_files(tmp_path / "two", plugin="demo", weights_name=NAME)) == 2
    for folder in ("one", "two"):
        got = read_state_dict(tmp_path / folder, plugin="demo", weights_name=NAME)
        assert sorted(got) == sorted(state)
        for k in state:
            torch.testing.assert_close(got[k], state[k], rtol=0, atol=0)


def test_named_weights_ignore_other_files_and_name_what_is_missing(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / NAME))
    save_file({"w": torch.ones(2, dtype=torch.float16)}, str(tmp_path / "diffusion_pytorch_model.fp16.safetensors"))
    assert weight_files(tmp_path, plugin="demo", weights_name=NAME) == [tmp_path / NAME]
    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        weight_files(tmp_path, plugin="demo", weights_name="model.safetensors")


def test_any_name_mode_finds_the_only_index_or_every_file(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(1)}, str(tmp_path / "x.safetensors"))
    save_file({"b": torch.zeros(1)}, str(tmp_path / "y.safetensors"))
    assert weight_files(tmp_path, plugin="demo") == [tmp_path / "x.safetensors", tmp_path / "y.safetensors"]
    assert sorted(read_state_dict(tmp_path, plugin="demo")) == ["a", "b"]
    _write_sharded(tmp_path / "s", {"a": torch.zeros(1), "b": torch.ones(1)}, name="model.safetensors")
    assert [p.name for p in weight_files(tmp_path / "s", plugin="demo")] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (tmp_path / "s" / "other.safetensors.index.json").write_text('{"weight_map": {"a": "z.safetensors"}}')
    with pytest.raises(CheckpointError, match="several safetensors indexes"):
        weight_files(tmp_path / "s", plugin="demo")
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        weight_files(tmp_path / "empty", plugin="demo")


def test_broken_indexes_and_duplicate_names_are_errors(tmp_path: Path) -> None:
    _write_sharded(tmp_path, {"a": torch.zeros(1), "b": torch.ones(1)})
    (tmp_path / "diffusion_pytorch_model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard diffusion_pytorch_model-00002-of-00002.safetensors named by"):
        weight_files(tmp_path, plugin="demo", weights_name=NAME)
    (tmp_path / f"{NAME}.index.json").write_text('{"weight_map": {}}')
    with pytest.raises(CheckpointError, match="has no weight_map"):
        weight_files(tmp_path, plugin="demo", weights_name=NAME)
    dup = tmp_path / "dup"
    dup.mkdir()
    save_file({"a": torch.zeros(1)}, str(dup / "1.safetensors"))
    save_file({"a": torch.ones(1)}, str(dup / "2.safetensors"))
    with pytest.raises(CheckpointError, match="weight a appears in more than one shard"):
        read_state_dict(dup, plugin="demo")


def test_prefix_and_key_subset(tmp_path: Path) -> None:
    save_file({"vae.enc.w": torch.full((2,), 1.0), "vae.dec.w": torch.full((2,), 2.0), "dit.w": torch.zeros(3)},
              str(tmp_path / "model.safetensors"))
    got = read_state_dict(tmp_path, plugin="demo", prefix="vae.")
    assert sorted(got) == ["dec.w", "enc.w"] and got["dec.w"].tolist() == [2.0, 2.0]
    got = read_state_dict(tmp_path, plugin="demo", prefix="vae.", keys=["enc.w"])
    assert list(got) == ["enc.w"]
    with pytest.raises(WeightMismatch) as info:
        read_state_dict(tmp_path, plugin="demo", keys=["dit.w", "dit.b"], component="dit")
    assert info.value.missing == ["dit.b"] and info.value.component == "dit"


def test_load_strict_names_missing_unexpected_and_misshaped_together(tmp_path: Path) -> None:
    model = _tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = {k: torch.randn_like(v) for k, v in before.items()}
    del state["1.bias"]
    state["extra.weight"] = torch.zeros(1)
    state["0.weight"] = torch.zeros(5, 3)
    with pytest.raises(WeightMismatch) as info:
        load_strict(model, state, plugin="demo", path=tmp_path, component="transformer")
    err = info.value
    assert err.missing == ["1.bias"] and err.unexpected == ["extra.weight"]
    assert err.mismatched == ["0.weight (checkpoint (5, 3), model (4, 3))"]
    text = str(err)
    assert "missing weights: 1.bias" in text and "unexpected weights: extra.weight" in text
    assert "shape mismatch weights: 0.weight" in text and "transformer" in text
    for k, v in model.state_dict().items():  # nothing was loaded
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


def test_load_strict_copies_or_assigns_into_a_meta_model(tmp_path: Path) -> None:
    state = {k: torch.randn_like(v) for k, v in _tiny().state_dict().items()}
    model = _tiny()
    load_strict(model, state, plugin="demo", path=tmp_path)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, state[k], rtol=0, atol=0)
        assert v.data_ptr() != state[k].data_ptr()  # copied
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    load_strict(meta, state, plugin="demo", path=tmp_path, assign=True)
    for k, v in meta.state_dict().items():
        assert v.device.type == "cpu" and v.data_ptr() == state[k].data_ptr()  # taken over, no second copy
    x = torch.randn(2, 3)
    torch.testing.assert_close(meta(x), model(x))


def test_long_name_lists_are_shortened_in_the_message_only(tmp_path: Path) -> None:
    err = WeightMismatch("demo", tmp_path, missing=[f"w{i:02d}" for i in range(25)])
    assert len(err.missing) == 25 and "(+5 more)" in str(err) and "w24" not in str(err)


def test_exported_from_the_plugin_api() -> None:
    import omnicore.plugin as api

    assert api.CheckpointError is CheckpointError and api.WeightMismatch is WeightMismatch
    assert api.load_strict is load_strict and api.read_state_dict is read_state_dict
    assert api.weight_files is weight_files and api.read_json is read_json
