"""Kohya / A1111 adapter files for HunyuanImage-3 go through the model's converter like PEFT files of the same
names: a file in the release's naming (a shared MLP's fused ``gate_and_up_proj``, rows ``[up | gate]``; the
head-grouped ``qkv_proj``) converts to exactly the tensors its PEFT twin does (split into ``up_proj`` /
``gate_proj``, qkv rows ungrouped), which the engine tests show equal peft's merged model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from _lora_helpers import peft_to_kohya
from omnicore.lora import TargetMap
from omnicore.lora.formats import convert, read_adapter
from safetensors.torch import save_file


def test_a_kohya_file_in_the_release_naming_converts_like_its_peft_twin(pipe: Any, tmp_path: Path) -> None:
    from omni_hunyuan.plugin import LORA_TARGETS

    model = pipe.model
    tmap = TargetMap.build(model, LORA_TARGETS, "hunyuan-image3")
    up = tmap.shapes["model.layers.0.mlp.shared_mlp.up_proj"]
    qkv = tmap.shapes["model.layers.0.self_attn.qkv_proj"]
    g = torch.Generator().manual_seed(0)
    rank = 4
    release = {"model.layers.0.mlp.shared_mlp.gate_and_up_proj": (up[0], 2 * up[1]),
               "model.layers.0.self_attn.qkv_proj": qkv}
    tensors = {}
    for name, (fan_in, fan_out) in release.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g)
        tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g)
    peft = tmp_path / "release"
    peft.mkdir()
    save_file(tensors, str(peft / "adapter_model.safetensors"))
    (peft / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 8,
                                                          "target_modules": sorted(release)}))
    kohya = peft_to_kohya(peft, tmp_path / "release_kohya.safetensors")
    want = convert(read_adapter(peft, "release"), tmap).modules
    got = convert(read_adapter(kohya, "kohya"), tmap).modules
    assert sorted(want) == sorted(got) == ["model.layers.0.mlp.shared_mlp.gate_proj",
                                           "model.layers.0.mlp.shared_mlp.up_proj",
                                           "model.layers.0.self_attn.qkv_proj"]
    for name in want:
        for w, k in zip(want[name], got[name]):
            torch.testing.assert_close(k, w, atol=0, rtol=0)
    fused_b = tensors["base_model.model.model.layers.0.mlp.shared_mlp.gate_and_up_proj.lora_B.weight"] * 2
    torch.testing.assert_close(got["model.layers.0.mlp.shared_mlp.up_proj"][1], fused_b[: up[1]], atol=0, rtol=0)
