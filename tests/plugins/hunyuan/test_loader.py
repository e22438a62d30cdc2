"""Loader transforms and strictness on the release layout."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F


def test_qkv_ungroup_follows_the_kv_head_groups():
    from omni_hunyuan.loader import group_qkv, ungroup_qkv

    kv, g, d, hidden = 2, 3, 4, 5
    # grouped rows: for each kv head, g query heads then k then v; tag each row with (kv, slot, dim)
    rows = torch.tensor([[100 * h + 10 * s + i] * hidden for h in range(kv) for s in range(g + 2) for i in range(d)],
                        dtype=torch.float32)
    flat = ungroup_qkv(rows, kv, g, d)[:, 0].tolist()
    q = [100 * h + 10 * s + i for h in range(kv) for s in range(g) for i in range(d)]
    k = [100 * h + 10 * g + i for h in range(kv) for i in range(d)]
    v = [100 * h + 10 * (g + 1) + i for h in range(kv) for i in range(d)]
    assert flat == q + k + v
    w = torch.randn(kv * (g + 2) * d, hidden)
    assert torch.equal(group_qkv(ungroup_qkv(w, kv, g, d), kv, g, d), w)


def test_fused_up_gate_split_keeps_the_release_math():
    """Release MLP: x1, x2 = gate_and_up_proj(x).chunk(2); out = down(x1 * silu(x2)) -> x1 is 'up', x2 'gate'."""
    from omni_hunyuan.loader import split_up_gate
    from omni_hunyuan.transformer.blocks import MLP

    fused, down = torch.randn(12, 8), torch.randn(8, 6)
    x = torch.randn(3, 8)
    x1, x2 = (x @ fused.t()).chunk(2, dim=-1)
    release = (x1 * F.silu(x2)) @ down.t()
    mlp = MLP(8, 6)
    gate, up = split_up_gate(fused)
    with torch.no_grad():
        mlp.gate_proj.weight.copy_(gate)
        mlp.up_proj.weight.copy_(up)
        mlp.down_proj.weight.copy_(down)
    assert torch.allclose(mlp(x), release, atol=1e-5)


def test_checkpoint_uses_release_names(micro_dir):
    from omni_hunyuan.loader import read_safetensors_names

    names = set(read_safetensors_names(micro_dir))
    for expected in ("model.wte.weight", "model.ln_f.weight", "lm_head.weight",
                     "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.query_layernorm.weight",
                     "model.layers.1.mlp.gate.wg.weight", "model.layers.1.mlp.experts.3.gate_and_up_proj.weight",
                     "model.layers.1.mlp.experts.3.down_proj.weight",
                     "model.layers.0.mlp.shared_mlp.gate_and_up_proj.weight",
                     "patch_embed.model.0.weight", "patch_embed.model.1.in_layers.2.weight",
                     "final_layer.model.1.2.weight", "timestep_emb.mlp.0.weight", "time_embed_2.mlp.2.bias",
                     "vae.encoder.down.0.downsample.conv.weight", "vae.decoder.mid.attn_1.proj_out.weight",
                     "vision_model.embeddings.patch_embedding.weight", "vision_aligner.layers.2.weight"):
        assert expected in names, expected
    assert not any(".w_gate" in n or "gate_proj" in n for n in names)
    index = json.loads((micro_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2


def test_save_load_round_trip(pipe, tmp_path):
    from omni_hunyuan.loader import load_state, save_checkpoint
    from omni_hunyuan.transformer.model import HunyuanImage3

    save_checkpoint(pipe.model, tmp_path, shards=3)
    other = HunyuanImage3(pipe.config)
    load_state(other, tmp_path)
    mine = dict(pipe.model.named_parameters())
    for name, p in other.named_parameters():
        assert torch.equal(p, mine[name]), name


def _copy(src, dst, mutate):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        mutate(tensors)
        save_file(tensors, str(f))
    return dst


def test_missing_and_unexpected_tensors_are_named(pipe, micro_dir, tmp_path):
    from omni_hunyuan.loader import CheckpointError, load_state
    from omni_hunyuan.transformer.model import HunyuanImage3

    def drop(t):
        t.pop("model.layers.1.mlp.experts.2.gate_and_up_proj.weight", None)
        t.pop("vae.decoder.conv_out.bias", None)
        if "model.wte.weight" in t:
            t["model.extra_thing.weight"] = torch.zeros(1)

    bad = _copy(micro_dir, tmp_path / "bad", drop)
    with pytest.raises(CheckpointError) as info:
        load_state(HunyuanImage3(pipe.config), bad)
    msg = str(info.value)
    assert "model.layers.1.mlp.experts.2.gate_and_up_proj.weight" in msg and "vae.decoder.conv_out.bias" in msg
    assert "unexpected 1 tensor(s): model.extra_thing.weight" in msg


def test_shape_mismatch_is_named(pipe, micro_dir, tmp_path):
    from omni_hunyuan.loader import CheckpointError, load_state
    from omni_hunyuan.transformer.model import HunyuanImage3

    def shrink(t):
        if "lm_head.weight" in t:
            t["lm_head.weight"] = t["lm_head.weight"][:10].contiguous()

    bad = _copy(micro_dir, tmp_path / "bad", shrink)
    with pytest.raises(CheckpointError, match=r"lm_head.weight has shape \(10, 64\)"):
        load_state(HunyuanImage3(pipe.config), bad)


def test_vision_head_weights_are_dropped(pipe, micro_dir, tmp_path):
    from omni_hunyuan.loader import load_state
    from omni_hunyuan.transformer.model import HunyuanImage3

    def add_head(t):
        if "model.wte.weight" in t:
            t["vision_model.head.probe"] = torch.zeros(1, 1, 32)

    extra = _copy(micro_dir, tmp_path / "head", add_head)
    load_state(HunyuanImage3(pipe.config), extra)  # no error: the head is unused by the aligner


def test_config_errors_name_the_field():
    from omni_hunyuan.transformer.config import ConfigFileError, HunyuanConfig
    from omni_hunyuan.presets import tiny_config

    cfg = tiny_config()
    with pytest.raises(ConfigFileError, match="vae"):
        HunyuanConfig.from_dict({k: v for k, v in cfg.items() if k != "vae"})
    with pytest.raises(ConfigFileError, match="num_key_value_heads"):
        HunyuanConfig.from_dict({**cfg, "num_key_value_heads": 3})
    with pytest.raises(ConfigFileError, match="img_proj_type"):
        HunyuanConfig.from_dict({**cfg, "img_proj_type": "linear"})


def test_detect(micro_dir, tmp_path):
    from omni_hunyuan.detect import detect

    assert detect(micro_dir) and not detect(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    assert not detect(tmp_path)


def test_per_layer_lists_must_be_uniform():
    from omni_hunyuan.transformer.config import ConfigFileError, HunyuanConfig
    from omni_hunyuan.presets import tiny_config

    cfg = tiny_config()
    ok = HunyuanConfig.from_dict({**cfg, "moe_topk": [2, 2], "num_experts": [4, 4], "moe_intermediate_size": [32, 32]})
    assert (ok.moe_topk, ok.num_experts, ok.moe_intermediate_size) == (2, 4, 32)
    with pytest.raises(ConfigFileError, match="moe_topk varies across layers"):
        HunyuanConfig.from_dict({**cfg, "moe_topk": [2, 1]})


def test_checkpoint_errors_are_typed_plugin_errors(tmp_path):
    from omni_hunyuan.loader import CheckpointError, shard_files
    from omnicore.errors import PluginError

    with pytest.raises(CheckpointError, match="no model.safetensors or model.safetensors.index.json") as info:
        shard_files(tmp_path)
    assert isinstance(info.value, PluginError) and info.value.plugin == "hunyuan" and info.value.path == tmp_path
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00002.safetensors"}}')
    with pytest.raises(CheckpointError, match="shard model-00001-of-00002.safetensors named by"):
        shard_files(tmp_path)
