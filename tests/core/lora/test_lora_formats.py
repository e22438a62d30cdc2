"""Every refusal of an adapter file names the adapter and the key; accepted layouts convert to the same deltas."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from _lora_helpers import MODULES, Toy, make_peft_adapter, peft_to_kohya
from omnicore.errors import InvalidRequest
from omnicore.lora import AdapterRegistry, LoRA, LoRAError, LoRATargets, TargetMap
from safetensors.torch import load_file, save_file

TARGETS = LoRATargets(modules=("blocks.*", "head"))


@pytest.fixture(scope="module")
def tmap() -> TargetMap:
    return TargetMap.build(Toy(), TARGETS, "toy")


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return make_peft_adapter(Toy(), MODULES, tmp_path / "good", rank=4, seed=1)


def _check(root: Path, name: str, tmap: TargetMap) -> None:
    AdapterRegistry(lora_dirs=[root]).check(LoRA(name), tmap)


def _refused(root: Path, name: str, tmap: TargetMap, key: str | None, match: str) -> LoRAError:
    with pytest.raises(LoRAError, match=match) as info:
        _check(root, name, tmap)
    assert info.value.adapter == name and info.value.key == key
    assert isinstance(info.value, InvalidRequest) and info.value.field == "loras"  # a 400 on every surface
    return info.value


def _rewrite(adapter: Path, change) -> None:
    path = adapter / "adapter_model.safetensors"
    tensors = dict(load_file(str(path)))
    change(tensors)
    save_file(tensors, str(path))


def test_peft_directory_scaling_is_alpha_over_r(good: Path, tmap: TargetMap) -> None:
    weights = AdapterRegistry(lora_dirs=[good.parent]).host_adapter(LoRA("good"), tmap)
    raw = load_file(str(good / "adapter_model.safetensors"))
    b = raw["base_model.model.blocks.0.q.lora_B.weight"]
    torch.testing.assert_close(weights.modules["blocks.0.q"][1], b * (8 / 4))  # lora_alpha 8, r 4
    assert sorted(weights.modules) == sorted(MODULES) and weights.layout == "peft"


def test_kohya_and_diffusers_files_convert_to_the_same_weights(good: Path, tmap: TargetMap, tmp_path: Path) -> None:
    reg = AdapterRegistry(lora_dirs=[tmp_path])
    peft_to_kohya(good, tmp_path / "k.safetensors")
    raw = load_file(str(good / "adapter_model.safetensors"))  # diffusers' save_lora_weights layout + alphas
    diffusers = {k.replace("base_model.model.", "transformer."): v for k, v in raw.items()}
    diffusers.update({f"transformer.{m}.alpha": torch.tensor(8.0) for m in MODULES})
    save_file(diffusers, str(tmp_path / "d.safetensors"))
    want = reg.host_adapter(LoRA("good"), tmap).modules
    for name, layout in (("k.safetensors", "kohya"), ("d.safetensors", "diffusers")):
        got = reg.host_adapter(LoRA(name), tmap)
        assert got.layout == layout
        for module, (a, b) in want.items():
            torch.testing.assert_close(got.modules[module][0], a)
            torch.testing.assert_close(got.modules[module][1], b)


def test_unknown_key_is_refused(good: Path, tmap: TargetMap) -> None:
    _rewrite(good, lambda t: t.__setitem__("base_model.model.blocks.0.q.lora_magnitude_vector", torch.ones(32)))
    _refused(good.parent, "good", tmap, "base_model.model.blocks.0.q.lora_magnitude_vector", "unknown key")


def test_missing_and_non_adaptable_modules_are_refused(good: Path, tmap: TargetMap) -> None:
    def rename(t, old, new):
        for which in ("A", "B"):
            t[f"base_model.model.{new}.lora_{which}.weight"] = t.pop(f"base_model.model.{old}.lora_{which}.weight")

    _rewrite(good, lambda t: rename(t, "head", "blocks.7.q"))
    _refused(good.parent, "good", tmap, "base_model.model.blocks.7.q.lora_A.weight", "has no adaptable module")
    _rewrite(good, lambda t: rename(t, "blocks.7.q", "frozen"))
    _refused(good.parent, "good", tmap, "base_model.model.frozen.lora_A.weight", "is not adaptable")


def test_shape_and_rank_mismatches_are_refused(good: Path, tmap: TargetMap) -> None:
    key = "base_model.model.blocks.0.q.lora_A.weight"
    _rewrite(good, lambda t: t.__setitem__(key, torch.zeros(4, 15)))
    _refused(good.parent, "good", tmap, key, "shape mismatch")
    _rewrite(good, lambda t: t.__setitem__(key, torch.zeros(3, 16)))
    _refused(good.parent, "good", tmap, key, "rank mismatch")
    _rewrite(good, lambda t: [t.__setitem__(key, torch.zeros(6, 16)),
                              t.__setitem__(key.replace("lora_A", "lora_B"), torch.zeros(32, 6))])
    _refused(good.parent, "good", tmap, key, "the config says r=4")
    _rewrite(good, lambda t: t.pop(key.replace("lora_A", "lora_B")))
    _refused(good.parent, "good", tmap, key, "has no lora_B")


def test_non_safetensors_is_never_opened(good: Path, tmap: TargetMap) -> None:
    (good / "adapter_model.safetensors").rename(good / "adapter_model.bin")
    _refused(good.parent, "good", tmap, "adapter_model.safetensors", "pickled weights are never opened")
    (good.parent / "x.pt").write_bytes(b"not read")
    _refused(good.parent, "x.pt", tmap, "x.pt", "only .safetensors")
    (good.parent / "bad.safetensors").write_bytes(b"\x00garbage")
    _refused(good.parent, "bad.safetensors", tmap, "bad.safetensors", "not a readable safetensors")


def test_unsupported_peft_configs_are_refused(good: Path, tmap: TargetMap) -> None:
    config = json.loads((good / "adapter_config.json").read_text())
    for key, value, match in (("use_dora", True, "not supported"), ("bias", "all", "train biases"),
                              ("modules_to_save", ["head"], "replace whole modules"),
                              ("peft_type", "LOHA", "only LORA"), ("r", 0, "positive")):
        (good / "adapter_config.json").write_text(json.dumps({**config, key: value}))
        _refused(good.parent, "good", tmap, key, match)


def test_paths_outside_the_lora_dirs_are_refused(good: Path, tmap: TargetMap, tmp_path: Path) -> None:
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    _refused(allowed, str(good), tmap, None, "outside the allowed")  # an absolute path elsewhere
    _refused(allowed, "../good", tmap, None, "outside the allowed")  # a relative escape
    os.symlink(good, allowed / "link")  # a symlink pointing out
    _refused(allowed, "link", tmap, None, "outside the allowed")
    _refused(allowed, "nope", tmap, None, "no such adapter")
    with pytest.raises(LoRAError, match="no LoRA directory allows paths"):
        AdapterRegistry().check(LoRA(str(good)), tmap)
    shutil.copytree(good, allowed / "inside")
    _check(allowed, "inside", tmap)  # accepted once it lies inside
    _check(allowed, str(allowed / "inside"), tmap)


def test_request_records_validate(tmp_path: Path) -> None:
    from omnicore.engine.request import GenerationRequest
    from omnicore.lora import MAX_LORAS_PER_REQUEST

    for bad, match in ((float("inf"), "finite"), (float("nan"), "finite"), (1e6, "between"), (True, "finite")):
        with pytest.raises(InvalidRequest, match=match):
            LoRA("a", bad)
    with pytest.raises(InvalidRequest, match="non-empty"):
        LoRA(" ")
    with pytest.raises(InvalidRequest, match=f"at most {MAX_LORAS_PER_REQUEST}"):
        GenerationRequest("x", loras=["a"] * (MAX_LORAS_PER_REQUEST + 1))
    with pytest.raises(InvalidRequest, match="loras\\[0\\]"):
        GenerationRequest("x", loras=[3])
    assert GenerationRequest("x", loras="a").loras == (LoRA("a"),)
    assert LoRA.parse("./dir/a:0.5") == LoRA("./dir/a", 0.5) and LoRA.parse("C:/a") == LoRA("C:/a")
    assert GenerationRequest("x", loras=["a"]).batch_key() == GenerationRequest("x", loras=["b"]).batch_key()


class _Router(torch.nn.Module):
    """A module with a weight that is not an nn.Linear (a router, stacked experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4, 16))


def test_a_module_that_is_not_a_linear_is_named_with_its_class(tmp_path: Path) -> None:
    model = Toy()
    model.router = _Router()
    tmap = TargetMap.build(model, TARGETS, "toy")
    for name, module in (("router", "router"), ("inside", "router.experts.0.up")):
        folder = tmp_path / name
        folder.mkdir()
        save_file({f"base_model.model.{module}.lora_A.weight": torch.zeros(2, 16),
                   f"base_model.model.{module}.lora_B.weight": torch.zeros(4, 2)},
                  str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2}))
        _refused(tmp_path, name, tmap, f"base_model.model.{module}.lora_A.weight",
                 "module 'router' of model 'toy' is a _Router, not an nn.Linear")
