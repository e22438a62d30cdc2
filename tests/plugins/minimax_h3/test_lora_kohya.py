"""Kohya / A1111 adapter files for MiniMax-H3 go through the model's converter like PEFT files of the same names:
one in the release's naming (``lora_unet_blocks_0_attn_qkv_proj``, the fused qkv rows grouped per head) and one in
diffusers' (``lora_transformer_transformer_blocks_0_attn_to_q``, separate q/k/v, ``[up | gate]``) convert to
exactly the tensors their PEFT twins do, which the engine tests show equal peft's merged models."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _lora_helpers import make_peft_adapter, peft_to_kohya, plain_copy
from omnicore.lora import LoRAError, TargetMap
from omnicore.lora.formats import convert, read_adapter
from safetensors.torch import load_file, save_file

OURS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")
THEIRS = ("attn.to_q", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2")


def _converted(path: Path, tmap: TargetMap) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return convert(read_adapter(path, path.name), tmap).modules


def _assert_same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        for g, w in zip(got[name], want[name]):
            torch.testing.assert_close(g, w, atol=0, rtol=0)


@pytest.fixture(scope="module")
def dit(pipe: Any) -> Any:
    return next(iter(pipe.transformers.values()))


@pytest.fixture(scope="module")
def tmap(dit: Any) -> TargetMap:
    from omni_minimax_h3.plugin import LORA_TARGETS

    return TargetMap.build(dit, LORA_TARGETS, "minimax-h3")


def test_a_kohya_file_in_the_release_naming_converts_like_its_peft_twin(dit: Any, tmap: TargetMap,
                                                                        tmp_path: Path) -> None:
    from omni_minimax_h3.loader import ours_to_official

    modules = [f"blocks.{i}.{m}" for i in range(len(dit.blocks)) for m in OURS] + [
        "token_refiner.blocks.0.attn.qkv_proj"]
    ours = make_peft_adapter(dit, modules, tmp_path / "ours", rank=4, seed=1)
    release = tmp_path / "release"  # the release's layout: the fused qkv_proj's B rows grouped per head
    release.mkdir()
    state = load_file(str(ours / "adapter_model.safetensors"))
    ours_b = state["base_model.model.blocks.0.attn.qkv_proj.lora_B.weight"].clone()
    for key, value in list(state.items()):
        if ".attn.qkv_proj.lora_B." in key:
            state[key] = ours_to_official({"attn.qkv_proj.weight": value}, dit.config)["attn.qkv_proj.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(release / "adapter_model.safetensors"))
    shutil.copy(ours / "adapter_config.json", release / "adapter_config.json")
    kohya = peft_to_kohya(release, tmp_path / "release_kohya.safetensors")
    want = _converted(release, tmap)
    _assert_same(_converted(kohya, tmap), want)
    # the release's head-grouped rows read back to our [Q; K; V] (alpha / r = 2 folded in), not taken as they are
    torch.testing.assert_close(want["blocks.0.attn.qkv_proj"][1], ours_b * 2, atol=0, rtol=0)
    release_b = state["base_model.model.blocks.0.attn.qkv_proj.lora_B.weight"]
    assert not torch.equal(release_b, ours_b)


def test_a_kohya_file_in_diffusers_naming_converts_like_its_peft_twin(dit: Any, tmap: TargetMap,
                                                                      tmp_path: Path) -> None:
    from diffusers import MiniMaxH3Transformer3DModel
    from omni_minimax_h3.loader import ours_to_diffusers

    reference = MiniMaxH3Transformer3DModel(**dit.config.to_dict()).float().eval()
    reference.load_state_dict(ours_to_diffusers(plain_copy(dit).float().state_dict()), strict=False)
    modules = [f"transformer_blocks.{i}.{m}" for i in range(len(dit.blocks)) for m in THEIRS] + [
        "token_refiner.refiner_blocks.0.attn.to_k"]
    theirs = make_peft_adapter(reference, modules, tmp_path / "theirs", rank=4, seed=2)
    kohya = peft_to_kohya(theirs, tmp_path / "theirs_kohya.safetensors", prefix="lora_transformer_")
    want = _converted(theirs, tmap)
    assert "blocks.0.attn.qkv_proj" in want and "token_refiner.blocks.0.attn.qkv_proj" in want  # fused
    _assert_same(_converted(kohya, tmap), want)


def test_a_kohya_key_naming_no_module_is_refused_naming_it(tmap: TargetMap, tmp_path: Path) -> None:
    path = tmp_path / "bad.safetensors"
    save_file({"lora_unet_transformer_blocks_0_attn_to_z.lora_down.weight": torch.zeros(2, 8),
               "lora_unet_transformer_blocks_0_attn_to_z.lora_up.weight": torch.zeros(8, 2)}, str(path))
    with pytest.raises(LoRAError, match="no adaptable module named 'transformer_blocks_0_attn_to_z'") as info:
        _converted(path, tmap)
    assert info.value.key == "lora_unet_transformer_blocks_0_attn_to_z.lora_down.weight"
