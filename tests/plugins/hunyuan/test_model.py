"""Model parts against independent formulations: 2-D RoPE, span attention vs the dense mask, MoE routing, the
VAE's shape contract, the timestep features, and prompt-KV reuse vs full recompute at every step."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _hunyuan_helpers import request, square_image


# ---------------------------------------------------------------------------------------------- RoPE
def test_text_only_2d_rope_is_1d_rope():
    from omni_hunyuan.transformer.rope import positions_2d, rope_table

    pos = positions_2d(7, [])
    assert pos.tolist() == [[p, p] for p in range(7)]
    cos, sin = rope_table(pos, 16)
    # 1-D rotate-half RoPE: angle(p, i) = p / 10000^(2i/16) for i < 8, repeated for the second half
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    ang = torch.arange(7, dtype=torch.float64)[:, None] * inv[None]
    assert torch.allclose(cos, torch.cat([ang, ang], 1).cos().float(), atol=1e-6)
    assert torch.allclose(sin, torch.cat([ang, ang], 1).sin().float(), atol=1e-6)


def test_image_span_positions_follow_the_release_offsets():
    from omni_hunyuan.transformer.rope import positions_2d

    # text 0..4, a 2x3 image at 5 (6 tokens), text resumes at 5 + 6 = 11
    pos = positions_2d(13, [(5, 2, 3)])
    assert pos[:5].tolist() == [[p, p] for p in range(5)]
    by, bx = 5 + (6 - 2) // 2, 5 + (6 - 3) // 2  # 7, 6
    assert pos[5:11].tolist() == [[by + i, bx + j] for i in range(2) for j in range(3)]
    assert pos[11:].tolist() == [[11, 11], [12, 12]]
    # odd offsets truncate toward zero (the reference casts with .long())
    odd = positions_2d(4, [(0, 1, 2)])
    assert odd[0].tolist() == [(2 - 1) // 2, 0]


def test_rope_pairs_alternate_between_y_and_x():
    from omni_hunyuan.transformer.rope import rope_table

    cos, _ = rope_table(torch.tensor([[3, 0]]), 8)  # y = 3, x = 0
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    expected = torch.tensor([3 * inv[0], 0.0, 3 * inv[2], 0.0]).cos()
    assert torch.allclose(cos[0, :4], expected.float(), atol=1e-6)
    assert torch.allclose(cos[0, 4:], cos[0, :4])


# ---------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("spans,lq", [((), 20), (((3, 9),), 20), (((2, 5), (8, 14)), 20), (((2, 5), (8, 14)), 7),
                                      (((12, 20),), 9), (((0, 20),), 20)])
def test_span_attention_equals_the_dense_mask_reference(spans, lq):
    from omni_hunyuan.transformer.attention import dense_mask_attention, span_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, lq, 4, 8, generator=g)
    k = torch.randn(2, 20, 2, 8, generator=g)
    v = torch.randn(2, 20, 2, 8, generator=g)
    out = span_attention(q, k, v, spans)
    ref = dense_mask_attention(q, k, v, spans)
    assert torch.allclose(out, ref, atol=1e-5)


def test_dense_mask_is_causal_plus_bidirectional_spans():
    from omni_hunyuan.transformer.attention import dense_mask
    from omnicore.attention.metadata import AttentionSpan, QueryRun, query_runs

    m = dense_mask(6, 6, [(2, 4)])
    assert m[1].tolist() == [True, True, False, False, False, False]
    assert m[2].tolist() == [True, True, True, True, False, False]  # sees the whole span, not past it
    assert m[4].tolist() == [True] * 5 + [False]
    # the core's run plan (what span metadata is computed with): causal, the span, causal
    span = (AttentionSpan(2, 4),)
    assert query_runs(0, 6, span) == (QueryRun(0, 2, 2, causal=True), QueryRun(2, 4, 4), QueryRun(4, 6, 6, True))
    assert query_runs(3, 6, span) == (QueryRun(3, 4, 4), QueryRun(4, 6, 6, True))  # queries start inside the span


def test_span_attention_hands_metadata_to_a_backend():
    """A backend receives packed tensors and causal span metadata (document-relative key positions)."""
    pytest.importorskip("omnicore.attention.metadata")
    from omni_hunyuan.transformer.attention import SpanAttention, dense_mask_attention

    seen = []

    def backend(q, k, v, *, metadata=None, attn_mask=None, scale=None, causal=False):
        seen.append(metadata)
        lq, lk = metadata.max_seqlen_q, metadata.max_seqlen_k
        b = metadata.num_docs
        spans = [(s.start, s.end) for s in metadata.spans[0]]
        out = dense_mask_attention(q.reshape(b, lq, *q.shape[1:]), k.reshape(b, lk, *k.shape[1:]),
                                   v.reshape(b, lk, *v.shape[1:]), spans)
        return out.reshape(b * lq, *q.shape[1:])

    attend = SpanAttention(backend)
    q, k, v = torch.randn(2, 5, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    out = attend(q, k, v, [(4, 9)])
    assert attend.calls == 1 and seen[0].causal and seen[0].cu_seqlens_k == (0, 9, 18)
    assert [(s.start, s.end) for s in seen[0].spans[1]] == [(4, 9)]
    assert torch.allclose(out, dense_mask_attention(q, k, v, [(4, 9)]), atol=1e-6)


# ---------------------------------------------------------------------------------------------- MoE
def test_moe_matches_a_per_token_loop(pipe):
    moe = pipe.model.model.layers[0].mlp
    x = torch.randn(5, pipe.config.hidden_size)
    with torch.no_grad():
        out = moe(x)
        ref = torch.zeros_like(x)
        for i in range(5):
            probs = F.softmax(x[i].float() @ moe.gate.weight.float().t(), dim=-1)
            w, e = probs.topk(moe.top_k)
            w = w / w.sum()
            for weight, ex in zip(w.tolist(), e.tolist()):
                ex_w = moe.experts
                h = F.silu(x[i] @ ex_w.w_gate[ex].t()) * (x[i] @ ex_w.w_up[ex].t())
                ref[i] += weight * (h @ ex_w.w_down[ex].t())
            ref[i] += moe.shared_mlp(x[i:i + 1])[0]
    assert torch.allclose(out, ref, atol=1e-5)


# ---------------------------------------------------------------------------------------------- embedders, VAE
def test_timestep_features_are_cos_then_sin():
    from omni_hunyuan.transformer.blocks import timestep_embedding

    emb = timestep_embedding(torch.tensor([500.0]), 8)
    freqs = torch.exp(-math.log(10000.0) * torch.arange(4) / 4)
    assert torch.allclose(emb[0, :4], torch.cos(500.0 * freqs), atol=1e-5)
    assert torch.allclose(emb[0, 4:], torch.sin(500.0 * freqs), atol=1e-5)


def test_dcae_rearranges_are_inverse():
    from omni_hunyuan.vae import _channel_to_space, _space_to_channel

    x = torch.randn(1, 3, 4, 6, 8)
    for rt in (1, 2):
        y = _space_to_channel(x, rt)
        assert y.shape == (1, 3 * 4 * rt, 4 // rt, 3, 4)
        assert torch.equal(_channel_to_space(y, rt), x)


def test_vae_image_contract(pipe):
    """A still image is repeated to ffactor_temporal frames and encodes to one latent frame; decoding a one-frame
    latent yields ffactor_temporal frames internally, of which the last is returned."""
    vae = pipe.model.vae
    px = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        mean, logvar = vae.encode_moments(px)
        assert mean.shape == (1, 4, 1, 2, 2) and logvar.shape == mean.shape
        z = mean[:, :, 0]
        frames = vae.decoder(z[:, :, None])
        assert frames.shape == (1, 3, vae.ffactor_temporal, 32, 32)
        image = vae.decode(z)
    assert torch.allclose(image, (frames[:, :, -1] / 2 + 0.5).clamp(0, 1))


# ---------------------------------------------------------------------------------------------- KV reuse
def _loop(pipe, req, reuse):
    """Run a request; return every step's prediction of the cached path and of a full recompute."""
    from omni_hunyuan.sampler import euler_step

    prepared = pipe.preprocess(req)
    state = pipe.encode([prepared])
    item = state.extras["items"][0]
    layout, tokens = item["layout"], item["tokens"]
    cond = pipe.cond_features(prepared, layout)
    diffs, past = [], None
    lat = state.latents
    with torch.no_grad():
        for step in range(state.num_steps):
            rows = layout.rows
            t = torch.full((rows,), float(state.timesteps[step]))
            x = lat.expand(rows, -1, -1, -1)
            pred, kept = pipe.model.denoise(layout, tokens, item["rope"], x, t, past=past if reuse else None,
                                            cond=cond)
            if kept is not None:
                past = kept
            full = pipe.model.full_forward(layout, tokens, x, t, cond=cond)
            diffs.append((pred - full).abs().max().item())
            lat = euler_step(lat, pred[:1], state.extras["sigmas"][step], state.extras["sigmas"][step + 1])
    return diffs, past, layout


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_prompt_kv_reuse_equals_full_recompute_at_every_step(pipe, guidance):
    diffs, past, layout = _loop(pipe, request(guidance_scale=guidance, num_inference_steps=3), reuse=True)
    assert layout.rows == (2 if guidance > 1 else 1)
    assert past.length == layout.prefix_len and past.layers[0][0].shape[:2] == (layout.rows, layout.gen_end)
    assert len(diffs) == 3 and max(diffs) < 1e-4, diffs


def test_prompt_kv_reuse_with_a_condition_image(pipe):
    diffs, _, layout = _loop(pipe, request("make it blue", images=(square_image(),), num_inference_steps=2),
                             reuse=True)
    assert len(layout.cond) == 1 and max(diffs) < 1e-4, diffs


def test_later_steps_compute_only_the_target(pipe, monkeypatch):
    """After step 0 the decoder sees only [<timestep>, <img>*N] rows."""
    prepared = pipe.preprocess(request(num_inference_steps=2))
    state = pipe.encode([prepared])
    layout = state.extras["items"][0]["layout"]
    lengths = []
    original = pipe.model.run_layers

    def spy(hidden, *args, **kwargs):
        lengths.append(hidden.shape[1])
        return original(hidden, *args, **kwargs)

    monkeypatch.setattr(pipe.model, "run_layers", spy)
    for step in range(2):
        state = pipe.denoise_step(state, step)
    assert lengths == [layout.gen_end, layout.target_len]
    assert layout.target_len == 1 + layout.num_image_tokens


def test_core_sdpa_backend_serves_the_span_metadata():
    """Through omnicore's reference backend (what the engine selects on CPU) the result equals the dense mask."""
    reference = pytest.importorskip("omnicore.attention.reference")
    from omni_hunyuan.transformer.attention import SpanAttention, dense_mask_attention

    attend = SpanAttention(reference.sdpa_attention)
    g = torch.Generator().manual_seed(1)
    for lq, spans in ((20, [(3, 9), (12, 20)]), (9, [(12, 20)])):
        q = torch.randn(2, lq, 4, 8, generator=g)
        k, v = torch.randn(2, 20, 2, 8, generator=g), torch.randn(2, 20, 2, 8, generator=g)
        assert torch.allclose(attend(q, k, v, spans), dense_mask_attention(q, k, v, spans), atol=1e-5)
    assert attend.calls == 2
