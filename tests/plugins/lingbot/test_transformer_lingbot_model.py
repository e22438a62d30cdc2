"""Whole-model behaviour of the LingBot DiT: packed batch CFG == sequential, padding invariance, packed metadata."""

from __future__ import annotations

import pytest
import torch
from omni_lingbot.transformer.config import LingBotTransformerConfig
from omni_lingbot.transformer.model import LingBotVideoTransformer3DModel
from omnicore.attention.reference import sdpa_attention

TINY_DENSE = dict(patch_size=[1, 2, 2], in_channels=4, out_channels=4, hidden_size=64, num_attention_heads=2, depth=2,
                  intermediate_size=128, text_dim=32, freq_dim=32, axes_dims=[8, 12, 12], axes_lens=[64, 64, 64])
TINY_MOE = dict(TINY_DENSE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                n_group=2, topk_group=1, routed_scaling_factor=2.5, mlp_only_layers=[0])
TOL = dict(rtol=1e-5, atol=1e-5)


class RecordingAttention:
    """Wraps the reference backend and records how the model calls it."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, q, k, v, **kwargs):
        self.calls.append({"shape": tuple(q.shape), **{k_: v_ for k_, v_ in kwargs.items()}})
        return sdpa_attention(q, k, v, **kwargs)


def _model(raw: dict, attention=None) -> LingBotVideoTransformer3DModel:
    torch.manual_seed(0)
    model = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(raw), attention=attention)
    with torch.no_grad():  # random everything (incl. scale_shift_table, norms) so every term matters
        for name, p in model.named_parameters():
            is_norm_weight = name.split(".")[-2].startswith("norm")  # RMSNorm weights around 1, the rest around 0
            p.normal_(1.0 if is_norm_weight else 0.0, 0.2)
    return model.eval()


@pytest.fixture(params=["dense", "moe"])
def model(request):
    return _model(TINY_DENSE if request.param == "dense" else TINY_MOE)


def _inputs(b: int, text_len: int, frames: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 4, frames, 4, 6, generator=g)
    e = torch.randn(b, text_len, 32, generator=g)
    t = torch.rand(b, generator=g) * 1000
    return x, t, e


@torch.no_grad()
def test_packed_batch_cfg_equals_sequential_forwards(model):
    x, t, e = _inputs(3, 7)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[0, :7] = True
    mask[1, :4] = True
    mask[2, :2] = True
    e[1, 4:] = 1e3  # garbage in the padding must not matter
    packed = model(x, t, e, mask)
    assert packed.shape == x.shape
    for i, n in enumerate([7, 4, 2]):
        single = model(x[i:i + 1], t[i:i + 1], e[i:i + 1, :n])
        torch.testing.assert_close(packed[i:i + 1], single, **TOL)
    # different samples really produce different outputs (no accidental broadcasting)
    assert not torch.allclose(packed[0], packed[1], atol=1e-3)


@torch.no_grad()
def test_padded_single_sample_equals_unpadded(model):
    x, t, e = _inputs(1, 9, seed=2)
    mask = torch.ones(1, 9, dtype=torch.bool)
    mask[0, 6:] = False
    padded_e = e.clone()
    padded_e[0, 6:] = torch.randn(3, 32) * 50
    torch.testing.assert_close(model(x, t, padded_e, mask), model(x, t, e[:, :6]), **TOL)
    # the real length matters: without the mask the padding rows would be attended to
    assert not torch.allclose(model(x, t, padded_e), model(x, t, e[:, :6]), atol=1e-3)


@torch.no_grad()
def test_padding_rows_to_a_multiple_change_nothing(model):
    x, t, e = _inputs(2, 5, seed=3)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    torch.testing.assert_close(model(x, t, e, mask, pad_to_multiple=64), model(x, t, e, mask), **TOL)


@torch.no_grad()
def test_attention_gets_host_metadata_documents_and_no_mask():
    spy = RecordingAttention()
    model = _model(TINY_MOE, attention=spy)
    x, t, e = _inputs(2, 6, seed=4)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 2:] = False
    model(x, t, e, mask)
    n_video = 2 * 2 * 3  # frames 2, latent 4x6 with 2x2 patches
    assert len(spy.calls) == 2  # one call per block, whole batch packed
    for call in spy.calls:
        assert "attn_mask" not in call
        assert call["shape"] == (2 * n_video + 6 + 2, 2, 32)
        md = call["metadata"]  # host ints: the backend never reads a device tensor to plan the call
        assert md.cu_seqlens_q == (0, n_video + 6, 2 * n_video + 8) and md.cu_seqlens_k is None
        assert md.max_seqlen_q == n_video + 6 and md.valid_kv_length is None and not md.causal
        assert md.latent_grid == (2, 2, 3)
        assert "cu_seqlens_q" not in call and "cu_seqlens_k" not in call


@torch.no_grad()
def test_scalar_timestep_broadcasts_and_batch_samples_are_independent(model):
    x, t, e = _inputs(2, 4, seed=5)
    both = model(x, torch.tensor(321.0), e)
    torch.testing.assert_close(both[1:], model(x[1:], torch.tensor([321.0]), e[1:]), **TOL)


@torch.no_grad()
def test_timestep_and_text_drive_the_output(model):
    x, t, e = _inputs(1, 4, seed=6)
    base = model(x, t, e)
    assert not torch.allclose(base, model(x, t + 100.0, e), atol=1e-4)
    assert not torch.allclose(base, model(x, t, e.flip(1)), atol=1e-4)  # text order matters via RoPE


@torch.no_grad()
def test_bf16_cast_model_tracks_fp32():
    model = _model(TINY_DENSE)
    x, t, e = _inputs(2, 5, seed=7)
    ref = model(x, t, e)
    model.cast(torch.bfloat16)
    got = model(x, t, e)
    assert got.dtype == torch.float32
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 5e-2, float(err)


def test_input_shape_errors_are_clear(model):
    x, t, e = _inputs(1, 4)
    with pytest.raises(ValueError, match="patch_size"):
        model(torch.zeros(1, 4, 2, 5, 6), t, e)
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        model(x, t, torch.zeros(1, 4, 31))
    with pytest.raises(ValueError, match="timestep"):
        model(x, torch.tensor([1.0, 2.0]), e)
