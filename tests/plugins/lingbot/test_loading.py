"""Loading the repository layout: preset contents, strict DiT loading, sharded weights, save -> load round trip."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _lingbot_helpers import load, request, run
from omni_lingbot.loader import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, CheckpointError, WeightMismatch, save_transformer
from omni_lingbot.presets import build_tiny_lingbot
from omnicore.errors import PluginError
from omnicore.plugin import QWEN_SPECIAL_TOKENS
from safetensors.torch import load_file, save_file


def test_preset_writes_the_real_layout(tiny_dir):
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "LingBotVideoPipeline"
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
    for rel in ("transformer/config.json", f"transformer/{WEIGHTS_NAME}", "text_encoder/config.json",
                "text_encoder/model.safetensors", "processor/tokenizer.json", "processor/preprocessor_config.json",
                "vae/config.json", "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json"):
        assert (tiny_dir / rel).is_file(), rel
    dit = json.loads((tiny_dir / "transformer" / "config.json").read_text())
    assert dit["_class_name"] == "LingBotVideoTransformer3DModel"
    assert (dit["hidden_size"], dit["depth"], dit["text_dim"], dit["num_experts"]) == (64, 2, 32, 0)
    vocab = json.loads((tiny_dir / "processor" / "tokenizer.json").read_text())
    added = {t["content"] for t in vocab["added_tokens"]}
    assert set(QWEN_SPECIAL_TOKENS) <= added
    te = json.loads((tiny_dir / "text_encoder" / "config.json").read_text())
    assert te["text_config"]["hidden_size"] == dit["text_dim"]


def test_moe_preset_has_dense_block_0_and_moe_block_1(tiny_moe_dir):
    names = set(load_file(str(tiny_moe_dir / "transformer" / WEIGHTS_NAME)))
    assert "blocks.0.ffn.gate_proj.weight" in names and not any(n.startswith("blocks.0.ffn.experts") for n in names)
    assert {"blocks.1.ffn.router.weight", "blocks.1.ffn.router.e_score_correction_bias", "blocks.1.ffn.experts.w1",
            "blocks.1.ffn.experts.w2", "blocks.1.ffn.experts.w3",
            "blocks.1.ffn.shared_experts.gate_proj.weight"} <= names


def test_preset_build_is_deterministic(tiny_dir, tmp_path):
    again = build_tiny_lingbot(tmp_path / "again")
    for rel in (f"transformer/{WEIGHTS_NAME}", "text_encoder/model.safetensors",
                "vae/diffusion_pytorch_model.safetensors"):
        a, b = load_file(str(tiny_dir / rel)), load_file(str(again / rel))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), rel


def _copy_with_dit_weights(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    file = dst / "transformer" / WEIGHTS_NAME
    state = load_file(str(file))
    edit(state)
    save_file(state, str(file))
    return dst


def test_strict_loading_names_missing_and_unexpected_weights(tiny_dir, tmp_path):
    def edit(state):
        del state["blocks.1.attn.to_q.weight"]
        state["blocks.1.attn.to_qkv.weight"] = torch.zeros(3, 3)

    broken = _copy_with_dit_weights(tiny_dir, tmp_path / "broken", edit)
    with pytest.raises(WeightMismatch) as info:
        load(broken)
    err = info.value
    assert isinstance(err, PluginError) and err.plugin == "lingbot"
    assert err.missing == ["blocks.1.attn.to_q.weight"] and err.unexpected == ["blocks.1.attn.to_qkv.weight"]
    assert "blocks.1.attn.to_q.weight" in str(err) and "blocks.1.attn.to_qkv.weight" in str(err)


def test_strict_loading_names_shape_mismatches(tiny_dir, tmp_path):
    def edit(state):
        state["proj_out.bias"] = torch.zeros(3)

    broken = _copy_with_dit_weights(tiny_dir, tmp_path / "shape", edit)
    with pytest.raises(WeightMismatch, match=r"proj_out\.bias \(checkpoint \(3,\)"):
        load(broken)


def test_missing_parts_are_clear_errors(tiny_dir, tmp_path):
    partial = tmp_path / "partial"
    shutil.copytree(tiny_dir, partial)
    shutil.rmtree(partial / "vae")
    with pytest.raises(CheckpointError, match="vae/"):
        load(partial)
    (partial / "transformer" / WEIGHTS_NAME).unlink()
    shutil.copytree(tiny_dir / "vae", partial / "vae")
    with pytest.raises(CheckpointError, match="no diffusion_pytorch_model"):
        load(partial)
    with pytest.raises(CheckpointError, match="model_index.json"):
        load(tmp_path)


def test_save_load_round_trip_with_sharded_weights(pipe, tiny_dir, tmp_path):
    """Re-save the loaded DiT (sharded with an index) and the VAE; the reloaded pipeline is bit-identical."""
    _, expected = run(pipe, request(seed=5))
    copy = tmp_path / "resaved"
    shutil.copytree(tiny_dir, copy)
    shutil.rmtree(copy / "transformer")
    shutil.rmtree(copy / "vae")
    save_transformer(pipe.transformer, copy / "transformer", max_shard_bytes=100_000)
    pipe.vae.vae.save_pretrained(str(copy / "vae"))
    index = json.loads((copy / "transformer" / WEIGHTS_INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert not (copy / "transformer" / WEIGHTS_NAME).exists()
    _, got = run(load(copy), request(seed=5))
    assert np.array_equal(got[0].frames, expected[0].frames)


def test_changed_weights_change_the_output(pipe, tiny_dir, tmp_path):
    def edit(state):
        state["proj_out.weight"] = state["proj_out.weight"] * 1.5

    _, expected = run(pipe, request(seed=5))
    _, got = run(load(_copy_with_dit_weights(tiny_dir, tmp_path / "edited", edit)), request(seed=5))
    assert not np.array_equal(got[0].frames, expected[0].frames)


def test_sharded_index_with_missing_shard_is_an_error(pipe, tiny_dir, tmp_path):
    copy = tmp_path / "sharded"
    shutil.copytree(tiny_dir, copy)
    shutil.rmtree(copy / "transformer")
    save_transformer(pipe.transformer, copy / "transformer", max_shard_bytes=100_000)
    next((copy / "transformer").glob("*-00001-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard .* is missing"):
        load(copy)


def test_unknown_transformer_config_key_warns_and_loads(pipe, tiny_dir, tmp_path, caplog):
    """A repo whose transformer/config.json carries a key this model does not know (a newer release's field)
    loads as the reference and diffusers load it: a warning naming the key, the same output."""
    copy = tmp_path / "extra-key"
    shutil.copytree(tiny_dir, copy)
    cfg_path = copy / "transformer" / "config.json"
    cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), "some_future_option": True}))
    with caplog.at_level("WARNING", logger="omni_lingbot"):
        loaded = load(copy)
    assert any("some_future_option" in r.getMessage() for r in caplog.records)
    _, expected = run(pipe, request(seed=5))
    _, got = run(loaded, request(seed=5))
    assert np.array_equal(got[0].frames, expected[0].frames)
