"""LingBot DiT config, checkpoint key names and the fp32-kept dtype policy."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from omni_lingbot.transformer.config import LingBotTransformerConfig
from omni_lingbot.transformer.model import LingBotVideoTransformer3DModel
from omnicore.errors import ConfigError

TINY_DENSE = dict(patch_size=[1, 2, 2], in_channels=4, out_channels=4, hidden_size=64, num_attention_heads=2, depth=2,
                  intermediate_size=128, text_dim=32, freq_dim=32, axes_dims=[8, 12, 12], axes_lens=[64, 64, 64])
TINY_MOE = dict(TINY_DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                n_group=2, topk_group=1, routed_scaling_factor=2.5, mlp_only_layers=[0])

# The config.json keys and defaults
SPEC_DEFAULTS = {
    "patch_size": (1, 2, 2), "in_channels": 16, "out_channels": 16, "hidden_size": 2048, "num_attention_heads": 16,
    "depth": 24, "intermediate_size": 6144, "text_dim": 2560, "freq_dim": 256, "norm_eps": 1e-6, "rope_theta": 256.0,
    "axes_dims": (32, 48, 48), "axes_lens": (8192, 1024, 1024), "qkv_bias": False, "out_bias": True,
    "patch_embed_bias": True, "timestep_mlp_bias": True, "num_experts": 0, "num_experts_per_tok": 8,
    "moe_intermediate_size": 512, "decoder_sparse_step": 1, "mlp_only_layers": (), "n_shared_experts": None,
    "score_func": "sigmoid", "norm_topk_prob": True, "n_group": None, "topk_group": None, "routed_scaling_factor": 1.0,
}


def test_defaults_are_the_spec_defaults():
    cfg = LingBotTransformerConfig()
    d = cfg.to_dict()
    assert set(d) == set(SPEC_DEFAULTS)
    for key, value in SPEC_DEFAULTS.items():
        got = getattr(cfg, key)
        assert got == value, key
    assert cfg.head_dim == 128


def test_from_dict_ignores_metadata_and_round_trips_through_json():
    raw = dict(TINY_MOE, _class_name="LingBotVideoTransformer3DModel", _diffusers_version="0.36.0")
    cfg = LingBotTransformerConfig.from_dict(json.loads(json.dumps(raw)))
    assert cfg.patch_size == (1, 2, 2) and cfg.mlp_only_layers == (0,) and cfg.n_group == 2
    again = LingBotTransformerConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    assert json.loads(json.dumps(cfg.to_dict()))["axes_dims"] == [8, 12, 12]


def test_unknown_keys_warn_by_name_and_are_ignored(caplog):
    """As the reference and diffusers: a key this model does not know is ignored with a warning naming it."""
    with caplog.at_level(logging.WARNING, logger="omni_lingbot"):
        cfg = LingBotTransformerConfig.from_dict(dict(TINY_DENSE, bogus_key=1, other=2))
    assert cfg == LingBotTransformerConfig.from_dict(TINY_DENSE)
    warned = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "bogus_key" in warned and "other" in warned


def test_text_embedder_norm_eps_is_fixed_at_1e_6():
    """The reference fixes the text embedder's RMSNorm eps at 1e-6; ``norm_eps`` is for the blocks and norm_out."""
    torch.manual_seed(0)
    model = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(dict(TINY_DENSE, norm_eps=1e-2)))
    assert model.text_embedder.norm.eps == 1e-6
    assert model.blocks[0].norm1.eps == 1e-2 and model.norm_out.eps == 1e-2
    # and numerically: small-magnitude text states (where the eps matters) normalise with 1e-6
    x = torch.randn(1, 3, TINY_DENSE["text_dim"]) * 1e-2
    with torch.no_grad():
        model.text_embedder.norm.weight.uniform_(0.5, 1.5)
        got = model.text_embedder.norm(x)
    want = model.text_embedder.norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"axes_dims": [8, 12, 10]}, "axes_dims"),  # sums to 30, head_dim is 32
        ({"num_attention_heads": 3}, "num_attention_heads"),
        ({"score_func": "relu"}, "score_func"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts": 4, "num_experts_per_tok": 2, "n_group": 3, "topk_group": 1}, "n_group"),
        ({"num_experts": 4, "num_experts_per_tok": 2, "n_group": 2}, "topk_group"),
        ({"patch_size": [1, 2]}, "patch_size"),
    ],
)
def test_invalid_configs_name_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        LingBotTransformerConfig.from_dict(dict(TINY_DENSE, **override))
    assert info.value.name == field


def test_moe_layer_rule():
    cfg = LingBotTransformerConfig.from_dict(dict(TINY_MOE, depth=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not LingBotTransformerConfig.from_dict(TINY_DENSE).is_moe_layer(1)


def _expected_keys(depth: int, moe_layers: set[int], shared: bool) -> list[str]:
    """The checkpoint key list, spelled out by hand."""
    keys = ["patch_embedder.weight", "patch_embedder.bias",
            "time_embedder.linear_1.weight", "time_embedder.linear_1.bias",
            "time_embedder.linear_2.weight", "time_embedder.linear_2.bias",
            "time_modulation.1.weight", "time_modulation.1.bias",
            "text_embedder.norm.weight", "text_embedder.linear_1.weight", "text_embedder.linear_1.bias",
            "text_embedder.linear_2.weight", "text_embedder.linear_2.bias"]
    for n in range(depth):
        p = f"blocks.{n}."
        keys += [p + "scale_shift_table", p + "norm1.weight", p + "attn.to_q.weight", p + "attn.to_k.weight",
                 p + "attn.to_v.weight", p + "attn.norm_q.weight", p + "attn.norm_k.weight", p + "attn.to_out.weight",
                 p + "attn.to_out.bias", p + "norm_post_attn.weight", p + "norm2.weight", p + "norm_post_ffn.weight"]
        if n in moe_layers:
            keys += [p + "ffn.router.weight", p + "ffn.router.e_score_correction_bias",
                     p + "ffn.experts.w1", p + "ffn.experts.w2", p + "ffn.experts.w3"]
            if shared:
                keys += [p + f"ffn.shared_experts.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
        else:
            keys += [p + f"ffn.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    keys += ["norm_out_modulation.1.weight", "norm_out_modulation.1.bias", "proj_out.weight", "proj_out.bias"]
    return sorted(keys)


@pytest.mark.parametrize(("raw", "moe_layers"), [(TINY_DENSE, set()), (TINY_MOE, {1})], ids=["dense", "moe"])
def test_state_dict_keys_match_checkpoint_layout(raw, moe_layers):
    model = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(raw))
    sd = model.state_dict()
    assert sorted(sd) == _expected_keys(2, moe_layers, shared=True)
    # shapes a checkpoint writer relies on
    assert sd["patch_embedder.weight"].shape == (64, 1 * 2 * 2 * 4)
    assert sd["blocks.0.scale_shift_table"].shape == (1, 6 * 64)
    assert sd["proj_out.weight"].shape == (2 * 2 * 4, 64)
    if moe_layers:
        assert sd["blocks.1.ffn.experts.w1"].shape == (4, 32, 64)
        assert sd["blocks.1.ffn.experts.w2"].shape == (4, 64, 32)
        assert sd["blocks.1.ffn.router.weight"].shape == (4, 64)
    # strict round trip into a fresh model
    fresh = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(raw))
    fresh.load_state_dict(sd, strict=True)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, sd[key]), key


def test_bias_flags_change_the_key_set():
    cfg = LingBotTransformerConfig.from_dict(dict(TINY_DENSE, qkv_bias=True, out_bias=False, patch_embed_bias=False,
                                                  timestep_mlp_bias=False, depth=1))
    keys = set(LingBotVideoTransformer3DModel(cfg).state_dict())
    assert "blocks.0.attn.to_q.bias" in keys and "blocks.0.attn.to_out.bias" not in keys
    assert "patch_embedder.bias" not in keys and "time_embedder.linear_1.bias" not in keys


def test_bf16_cast_keeps_the_listed_modules_fp32():
    model = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(TINY_MOE)).cast(torch.bfloat16)
    fp32_prefixes = ("time_embedder.", "time_modulation.", "text_embedder.norm.", "norm_out_modulation.")
    fp32_block_parts = ("scale_shift_table", "norm1.", "norm2.", "attn.norm_q.", "attn.norm_k.", "norm_post_attn.",
                        "norm_post_ffn.", "ffn.router.")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        local = name.split(".", 2)[2] if name.startswith("blocks.") else ""
        kept = name.startswith(fp32_prefixes) or local.startswith(fp32_block_parts)
        assert tensor.dtype == (torch.float32 if kept else torch.bfloat16), name
    assert "router" in LingBotVideoTransformer3DModel.keep_fp32_modules
