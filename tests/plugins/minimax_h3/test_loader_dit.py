"""Loader of the MiniMax-H3 DiT: both checkpoint layouts, the state-dict transforms, strictness, config keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _dit_helpers import build_reference, fl2va_layout, request_inputs, save_reference, tiny_config, to_layout
from omni_minimax_h3.loader import (
    WeightMismatch,
    detect_transformer_format,
    diffusers_to_ours,
    load_transformer,
    official_to_ours,
    ours_to_diffusers,
    ours_to_official,
    read_transformer_config,
    save_transformer,
    transformer_dirs,
)
from omni_minimax_h3.transformer.config import MiniMaxH3TransformerConfig
from omnicore.errors import ConfigError
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    ref = build_reference(tiny_config(), seed=11)
    return ref, save_reference(ref, tmp_path_factory.mktemp("h3-loader") / "transformer")


def _forward(dit: Any) -> tuple[torch.Tensor, torch.Tensor]:
    raw = fl2va_layout(anchors=("first",))
    x = request_inputs(raw, dit.config, seed=1)
    batch = dit.pack([dit.prepare_request(to_layout(raw), x["text"])])
    ts = batch.step_timesteps([0.3], [0.4])
    with torch.no_grad():
        return dit(batch, x["video"], x["audio"], ts.unique_timesteps, ts.inverse_indices)


def test_diffusers_round_trip_is_exact(reference: tuple[Any, Path]) -> None:
    ref, _ = reference
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    ours = diffusers_to_ours(state)
    assert "blocks.0.attn.qkv_proj.weight" in ours and not any(k.startswith("transformer_blocks") for k in ours)
    back = ours_to_diffusers(ours)
    assert set(back) == set(state)
    assert all(torch.equal(back[k], state[k]) for k in state)


def test_diffusers_transform_fuses_qkv_and_swaps_swiglu_halves(reference: tuple[Any, Path]) -> None:
    ref, _ = reference
    state = ref.state_dict()
    ours = diffusers_to_ours(state)
    blk = "transformer_blocks.1."
    want_qkv = torch.cat([state[blk + f"attn.to_{n}.weight"] for n in "qkv"])
    assert torch.equal(ours["blocks.1.attn.qkv_proj.weight"], want_qkv)
    up, gate = state[blk + "ff.net.0.proj.weight"].chunk(2)  # diffusers SwiGLU: [hidden (up) | gate]
    assert torch.equal(ours["blocks.1.mlp.fc1.weight"], torch.cat([gate, up]))
    assert torch.equal(ours["final_layer.video_out.weight"], state["proj_out.weight"])
    assert torch.equal(ours["token_refiner.blocks.0.attn.out_proj.weight"],
                       state["token_refiner.refiner_blocks.0.attn.to_out.0.weight"])


def test_official_layout_is_head_grouped_and_round_trips(reference: tuple[Any, Path]) -> None:
    ref, _ = reference
    cfg = tiny_config()
    ours = diffusers_to_ours(ref.state_dict())
    official = ours_to_official(ours, cfg)
    grouped = official["blocks.0.attn.qkv_proj.weight"]
    d, h = cfg.attention_head_dim, cfg.hidden_size
    q, k, v = ours["blocks.0.attn.qkv_proj.weight"].chunk(3)
    # head 1 of the grouped layout = (q, k, v) of head 1
    assert torch.equal(grouped[3 * d:4 * d], q[d:2 * d]) and torch.equal(grouped[4 * d:5 * d], k[d:2 * d])
    assert torch.equal(grouped[5 * d:6 * d], v[d:2 * d]) and grouped.shape == (3 * cfg.inner_dim, h)
    back = official_to_ours(official, cfg)
    assert all(torch.equal(back[k], ours[k]) for k in ours) and set(back) == set(ours)
    assert torch.equal(official_to_ours(ours, cfg, qkv_layout="qkv")["blocks.0.attn.qkv_proj.weight"],
                       ours["blocks.0.attn.qkv_proj.weight"])


def test_both_layouts_load_to_the_same_model(reference: tuple[Any, Path], tmp_path: Path) -> None:
    _, path = reference
    assert detect_transformer_format(path) == "diffusers"
    dit = load_transformer(path)
    official_dir = save_transformer(dit, tmp_path / "FL2VA" / "transformer", format="official")
    raw = json.loads((official_dir / "config.json").read_text())
    assert raw["token_refiner_num_layers"] == 1 and raw["adaln_out_features"] == 18 * 64  # native key names
    assert "_class_name" not in raw and detect_transformer_format(official_dir) == "official"  # from the names
    with_rope = load_file(str(official_dir / "diffusion_pytorch_model.safetensors"))
    with_rope["rope.inv_freq"] = dit.rope.inv_freq.clone()  # the official checkpoint may carry it
    save_file(with_rope, str(official_dir / "diffusion_pytorch_model.safetensors"))
    assert detect_transformer_format(official_dir) == "official"
    dit2 = load_transformer(official_dir)
    for a, b in zip(_forward(dit), _forward(dit2)):
        assert torch.equal(a, b)
    again = save_transformer(dit2, tmp_path / "again", format="diffusers")
    assert json.loads((again / "config.json").read_text())["_class_name"] == "MiniMaxH3Transformer3DModel"
    a0 = load_file(str(path / "diffusion_pytorch_model.safetensors"))
    a1 = load_file(str(again / "diffusion_pytorch_model.safetensors"))
    assert set(a0) == set(a1) and all(torch.equal(a0[k], a1[k]) for k in a0)


def _corrupt(path: Path, target: Path, edit: Any) -> Path:
    target.mkdir(parents=True)
    (target / "config.json").write_text((path / "config.json").read_text())
    state = load_file(str(path / "diffusion_pytorch_model.safetensors"))
    edit(state)
    save_file(state, str(target / "diffusion_pytorch_model.safetensors"))
    return target


def test_strict_loading_names_missing_unexpected_and_misshaped(reference: tuple[Any, Path], tmp_path: Path) -> None:
    _, path = reference

    def edit(state: dict[str, torch.Tensor]) -> None:
        del state["transformer_blocks.0.attn.norm_k.weight"]
        state["transformer_blocks.0.attn.bogus.weight"] = torch.zeros(3)
        state["norm_out.linear.bias"] = torch.zeros(7)

    bad = _corrupt(path, tmp_path / "bad", edit)
    with pytest.raises(WeightMismatch) as info:
        load_transformer(bad)
    err = info.value
    assert err.missing == ["blocks.0.attn.k_norm.weight"]
    assert err.unexpected == ["blocks.0.attn.bogus.weight"]
    assert len(err.mismatched) == 1 and "final_layer.adaln_proj.linear.bias" in err.mismatched[0]
    assert "blocks.0.attn.k_norm.weight" in str(err) and "(7,)" in str(err)


def test_partial_qkv_is_reported_not_guessed(reference: tuple[Any, Path], tmp_path: Path) -> None:
    _, path = reference
    bad = _corrupt(path, tmp_path / "noq", lambda s: s.pop("transformer_blocks.1.attn.to_v.weight"))
    with pytest.raises(WeightMismatch) as info:
        load_transformer(bad)
    assert "blocks.1.attn.qkv_proj.weight" in info.value.missing
    assert {"blocks.1.attn.to_q.weight", "blocks.1.attn.to_k.weight"} <= set(info.value.unexpected)


def test_bf16_load_keeps_fp32_islands(reference: tuple[Any, Path]) -> None:
    _, path = reference
    dit = load_transformer(path, dtype=torch.bfloat16)
    dtypes = {n: p.dtype for n, p in dit.named_parameters()}
    assert dtypes["blocks.0.attn.qkv_proj.weight"] == torch.bfloat16
    assert dtypes["blocks.0.adaln_proj.linear.weight"] == torch.bfloat16
    for name in ("video_patch_proj.weight", "audio_patch_proj.bias", "time_embedder.proj_out.weight",
                 "final_layer.video_out.weight", "final_layer.audio_out.bias"):
        assert dtypes[name] == torch.float32, name
    assert dit.rope.inv_freq.dtype == torch.float32
    v, a = _forward(dit)
    assert torch.isfinite(v).all() and torch.isfinite(a).all()


def test_config_accepts_native_names_and_rejects_unknown_keys(reference: tuple[Any, Path]) -> None:
    _, path = reference
    cfg = read_transformer_config(path)
    assert cfg == tiny_config()
    native = {"num_layers": 3, "token_refiner_num_layers": 2, "ffn_hidden_size": 256, "latents_dim": 24,
              "hidden_size": 64, "rope_inv_freq_len": 4, "adaln_out_features": 18 * 64, "_class_name": "x"}
    c = MiniMaxH3TransformerConfig.from_dict(native)
    assert (c.num_layers, c.num_refiner_layers, c.ffn_dim, c.rope_freq_dim) == (3, 2, 256, 4)
    with pytest.raises(ConfigError, match="surprise"):
        MiniMaxH3TransformerConfig.from_dict({"surprise": 1})
    with pytest.raises(ConfigError, match="adaln_out_features"):
        MiniMaxH3TransformerConfig.from_dict({"hidden_size": 64, "adaln_out_features": 64})
    with pytest.raises(ConfigError, match="rope_freq_dim"):
        MiniMaxH3TransformerConfig(attention_head_dim=32, rope_freq_dim=8)
    assert MiniMaxH3TransformerConfig.from_dict(c.to_dict()) == c


def test_transformer_dirs_for_both_layouts(tmp_path: Path) -> None:
    for sub in ("diff/transformer", "diff/transformer_ref", "off/FL2VA/transformer", "off/Ref2VA/transformer",
                "single/transformer"):
        (tmp_path / sub).mkdir(parents=True)
        (tmp_path / sub / "config.json").write_text("{}")
    assert transformer_dirs(tmp_path / "diff") == {"fl2va": tmp_path / "diff/transformer",
                                                   "ref2va": tmp_path / "diff/transformer_ref"}
    assert transformer_dirs(tmp_path / "off") == {"fl2va": tmp_path / "off/FL2VA/transformer",
                                                  "ref2va": tmp_path / "off/Ref2VA/transformer"}
    (tmp_path / "single/model_index.json").write_text(json.dumps({"_minimax_h3": {"partition": "ref2va"}}))
    assert transformer_dirs(tmp_path / "single") == {"ref2va": tmp_path / "single/transformer"}


def test_sharded_diffusers_checkpoint_loads(reference: tuple[Any, Path], tmp_path: Path) -> None:
    ref, path = reference
    sharded = tmp_path / "sharded"
    ref.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="60KB")
    assert (sharded / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    for a, b in zip(_forward(load_transformer(path)), _forward(load_transformer(sharded))):
        assert torch.equal(a, b)


def test_official_rope_frequencies_are_checked(reference: tuple[Any, Path]) -> None:
    from omni_minimax_h3.loader import CheckpointError

    cfg = tiny_config()
    ours = diffusers_to_ours(reference[0].state_dict())
    wrong = {**ours_to_official(ours, cfg), "rope.inv_freq": torch.ones(cfg.rope_freq_dim)}
    with pytest.raises(CheckpointError, match="rope.inv_freq"):
        official_to_ours(wrong, cfg)
