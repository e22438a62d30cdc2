"""LingBot DiT pieces against explicit formulas: patchify order, RoPE, time embedding, one block, the whole forward."""

from __future__ import annotations

import math

import pytest
import torch
from omni_lingbot.transformer.blocks import LingBotBlock
from omni_lingbot.transformer.config import LingBotTransformerConfig
from omni_lingbot.transformer.embeddings import patchify, sinusoidal_timestep_embedding, unpatchify
from omni_lingbot.transformer.layout import JointLayout
from omni_lingbot.transformer.model import LingBotVideoTransformer3DModel
from omni_lingbot.transformer.rope import LingBotRotaryEmbedding, apply_rotary, sample_positions
from omnicore.attention.reference import sdpa_attention

TINY = dict(patch_size=[1, 2, 2], in_channels=4, out_channels=4, hidden_size=64, num_attention_heads=2, depth=2,
            intermediate_size=128, text_dim=32, freq_dim=32, axes_dims=[8, 12, 12], axes_lens=[64, 64, 64])


# ----------------------------------------------------------------------------------------------- patchify
@pytest.mark.parametrize("patch", [(1, 2, 2), (2, 2, 3)])
def test_patchify_feature_order_is_pf_ph_pw_c(patch):
    pf, ph, pw = patch
    b, c, gt, gh, gw = 2, 3, 2, 3, 2
    x = torch.randn(b, c, gt * pf, gh * ph, gw * pw)
    tokens = patchify(x, patch)
    assert tokens.shape == (b, gt * gh * gw, pf * ph * pw * c)
    for bb in range(b):
        for it in range(gt):
            for ih in range(gh):
                for iw in range(gw):
                    n = (it * gh + ih) * gw + iw
                    for a in range(pf):
                        for r in range(ph):
                            for s in range(pw):
                                for ch in range(c):
                                    j = ((a * ph + r) * pw + s) * c + ch
                                    assert tokens[bb, n, j] == x[bb, ch, it * pf + a, ih * ph + r, iw * pw + s]
    assert torch.equal(unpatchify(tokens, (gt, gh, gw), patch), x)


def test_patchify_rejects_indivisible_shapes():
    with pytest.raises(ValueError, match="patch_size"):
        patchify(torch.zeros(1, 4, 1, 5, 4), (1, 2, 2))


# ----------------------------------------------------------------------------------------------- RoPE
def test_positions_video_after_text():
    # text_len=3, a 1x2x2 grid -> video t = 4, text (1..3, 0, 0)
    pos = sample_positions((1, 2, 2), 3)
    assert pos.tolist() == [[4, 0, 0], [4, 0, 1], [4, 1, 0], [4, 1, 1], [1, 0, 0], [2, 0, 0], [3, 0, 0]]
    pos = sample_positions((2, 1, 2), 0)
    assert pos.tolist() == [[1, 0, 0], [1, 0, 1], [2, 0, 0], [2, 0, 1]]


def _explicit_rope(x: torch.Tensor, pos: list[list[int]], axes_dims, theta: float) -> torch.Tensor:
    """Rotate interleaved pairs with per-position cos/sin computed in float64 Python math."""
    out = torch.empty(x.shape, dtype=torch.float64)
    for s, p in enumerate(pos):
        angles = []
        for axis, d in enumerate(axes_dims):
            angles += [p[axis] * theta ** (-(2 * i) / d) for i in range(d // 2)]
        for h in range(x.shape[1]):
            for i, ang in enumerate(angles):
                a, b = float(x[s, h, 2 * i]), float(x[s, h, 2 * i + 1])
                out[s, h, 2 * i] = a * math.cos(ang) - b * math.sin(ang)
                out[s, h, 2 * i + 1] = a * math.sin(ang) + b * math.cos(ang)
    return out


def test_rope_matches_explicit_cos_sin():
    axes, theta = (8, 12, 12), 256.0
    rope = LingBotRotaryEmbedding(axes, (64, 64, 64), theta)
    pos = sample_positions((2, 2, 3), 5)
    x = torch.randn(pos.shape[0], 2, sum(axes))
    got = apply_rotary(x, rope(pos))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _explicit_rope(x, pos.tolist(), axes, theta), rtol=1e-5, atol=2e-5)
    # bf16 input comes back bf16, rotated in fp32
    got_bf16 = apply_rotary(x.bfloat16(), rope(pos))
    assert got_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(got_bf16.float(), apply_rotary(x.bfloat16().float(), rope(pos)).bfloat16().float())


def test_rope_table_grows_by_half_when_positions_exceed_it():
    axes = (4, 6, 6)
    rope = LingBotRotaryEmbedding(axes, (4, 4, 4), 256.0)
    pos = torch.tensor([[10, 0, 3], [2, 5, 0]])
    freqs = rope(pos)
    # t=10 needs 11 rows: 4 -> 6 -> 9 -> 14; h=5 needs 6: 4 -> 6; w=3 fits
    assert rope.axes_lens == [14, 6, 4]
    assert rope.table(0, pos.device).shape == (14, 2)
    x = torch.randn(2, 1, sum(axes))
    torch.testing.assert_close(apply_rotary(x, freqs).double(), _explicit_rope(x, pos.tolist(), axes, 256.0),
                               rtol=1e-5, atol=2e-5)


# ----------------------------------------------------------------------------------------------- time embedding
def test_time_path_matches_diffusers_timestep_modules():
    from diffusers.models.embeddings import TimestepEmbedding, Timesteps

    cfg = LingBotTransformerConfig.from_dict(TINY)
    model = LingBotVideoTransformer3DModel(cfg)
    t = torch.tensor([999.0, 512.25, 3.0])
    ref_proj = Timesteps(cfg.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
    torch.testing.assert_close(sinusoidal_timestep_embedding(t, cfg.freq_dim), ref_proj(t))
    ref_emb = TimestepEmbedding(cfg.freq_dim, cfg.hidden_size, act_fn="silu")
    ref_emb.load_state_dict(model.time_embedder.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model.time_embedding(t), ref_emb(ref_proj(t)))


# ----------------------------------------------------------------------------------------------- block math
def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _reference_block(blk: LingBotBlock, x, temb6, pos, axes, theta, heads, eps):
    """The block formulas written out in float64 with real cos/sin RoPE and explicit softmax attention."""
    p = {k: v.detach().double() for k, v in blk.state_dict().items()}
    x = x.double()
    mod = temb6.double() + p["scale_shift_table"]
    sh1, s1, g1, sh2, s2, g2 = mod.chunk(6, dim=-1)
    h = _rms(x, p["norm1.weight"], eps) * (1 + s1) + sh1
    n, hd = x.shape[0], x.shape[1] // heads
    q = (h @ p["attn.to_q.weight"].t()).view(n, heads, hd)
    k = (h @ p["attn.to_k.weight"].t()).view(n, heads, hd)
    v = (h @ p["attn.to_v.weight"].t()).view(n, heads, hd)
    q = _explicit_rope(_rms(q, p["attn.norm_q.weight"], eps), pos, axes, theta)
    k = _explicit_rope(_rms(k, p["attn.norm_k.weight"], eps), pos, axes, theta)
    att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), dim=-1)
    o = torch.einsum("hqk,khd->qhd", att, v).reshape(n, -1)
    o = o @ p["attn.to_out.weight"].t() + p["attn.to_out.bias"]
    x = x + torch.tanh(g1) * _rms(o, p["norm_post_attn.weight"], eps)
    h = _rms(x, p["norm2.weight"], eps) * (1 + s2) + sh2
    gate, up = h @ p["ffn.gate_proj.weight"].t(), h @ p["ffn.up_proj.weight"].t()
    f = (gate * torch.sigmoid(gate) * up) @ p["ffn.down_proj.weight"].t()
    return x + torch.tanh(g2) * _rms(f, p["norm_post_ffn.weight"], eps)


def test_block_matches_handwritten_formulas():
    cfg = LingBotTransformerConfig.from_dict(dict(TINY, norm_eps=1e-5))
    torch.manual_seed(3)
    blk = LingBotBlock(cfg, 0)
    with torch.no_grad():
        for prm in blk.parameters():
            prm.normal_(0.0, 0.3)
    grid, text_len = (2, 2, 2), 5
    layout = JointLayout.build(grid, [text_len], torch.device("cpu"))
    x = torch.randn(layout.total, cfg.hidden_size)
    temb6 = torch.randn(1, 6 * cfg.hidden_size)
    rope = LingBotRotaryEmbedding(cfg.axes_dims, cfg.axes_lens, cfg.rope_theta)
    with torch.no_grad():
        got = blk(x, temb6, layout, rope(layout.positions), sdpa_attention)
    ref = _reference_block(blk, x, temb6, sample_positions(grid, text_len).tolist(), cfg.axes_dims, cfg.rope_theta,
                           cfg.num_attention_heads, cfg.norm_eps)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------- whole model
def _reference_model(model: LingBotVideoTransformer3DModel, x, t, text):
    """The forward of one sample in float64, from the spec text: patchify (permute 0,2,4,6,3,5,7,1), timestep
    and text embedders, ``[video ; text]`` through the reference blocks, final LayerNorm modulated by
    ``(shift, scale)``, the video rows unpatchified (permute 0,7,1,4,2,5,3,6)."""
    from diffusers.models.embeddings import Timesteps

    cfg = model.config
    p = {k: v.detach().double() for k, v in model.state_dict().items()}
    silu = torch.nn.functional.silu
    _, c, f, h, w = x.shape
    pf, ph, pw = cfg.patch_size
    grid = (f // pf, h // ph, w // pw)
    tokens = x.double().reshape(1, c, grid[0], pf, grid[1], ph, grid[2], pw).permute(0, 2, 4, 6, 3, 5, 7, 1)
    video = tokens.reshape(-1, pf * ph * pw * c) @ p["patch_embedder.weight"].t() + p["patch_embedder.bias"]
    t_freq = Timesteps(cfg.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)(t).double()
    t_emb = silu(t_freq @ p["time_embedder.linear_1.weight"].t() + p["time_embedder.linear_1.bias"])
    t_emb = t_emb @ p["time_embedder.linear_2.weight"].t() + p["time_embedder.linear_2.bias"]
    temb6 = silu(t_emb) @ p["time_modulation.1.weight"].t() + p["time_modulation.1.bias"]
    e = _rms(text[0].double(), p["text_embedder.norm.weight"], cfg.norm_eps)
    e = silu(e @ p["text_embedder.linear_1.weight"].t() + p["text_embedder.linear_1.bias"])
    e = e @ p["text_embedder.linear_2.weight"].t() + p["text_embedder.linear_2.bias"]
    hidden = torch.cat([video, e])
    pos = sample_positions(grid, text.shape[1]).tolist()
    for blk in model.blocks:
        hidden = _reference_block(blk, hidden, temb6, pos, cfg.axes_dims, cfg.rope_theta, cfg.num_attention_heads,
                                  cfg.norm_eps)
    shift, scale = (silu(t_emb) @ p["norm_out_modulation.1.weight"].t() + p["norm_out_modulation.1.bias"]).chunk(2, -1)
    vid = hidden[: video.shape[0]]
    vid = (vid - vid.mean(-1, keepdim=True)) / torch.sqrt(vid.var(-1, unbiased=False, keepdim=True) + cfg.norm_eps)
    out = (vid * (1 + scale) + shift) @ p["proj_out.weight"].t() + p["proj_out.bias"]
    out = out.reshape(1, *grid, pf, ph, pw, cfg.out_channels).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return out.reshape(1, cfg.out_channels, f, h, w)


def test_whole_dense_model_matches_the_spec_forward():
    cfg = LingBotTransformerConfig.from_dict(TINY)
    torch.manual_seed(4)
    model = LingBotVideoTransformer3DModel(cfg)
    with torch.no_grad():
        for name, prm in model.named_parameters():
            prm.normal_(1.0 if name.split(".")[-2].startswith("norm") else 0.0, 0.2)
    g = torch.Generator().manual_seed(0)
    x, text, t = torch.randn(1, 4, 2, 4, 6, generator=g), torch.randn(1, 5, 32, generator=g), torch.tensor([640.0])
    with torch.no_grad():
        got = model(x, t, text)
    torch.testing.assert_close(got.double(), _reference_model(model, x, t, text), rtol=1e-4, atol=1e-4)
