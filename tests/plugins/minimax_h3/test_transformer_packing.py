"""Packing of the DiT: layout validation, ``[real | pad]`` documents per request, and the attention seam (the
backend gets host metadata, never a mask; a single request's padding keys are marked as such)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dit_helpers import fl2va_layout, request_inputs, tiny_config, to_layout
from omni_minimax_h3.transformer.layout import RequestLayout
from omni_minimax_h3.transformer.model import MiniMaxH3DiT
from omnicore.attention.reference import sdpa_attention


class SpyAttention:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, metadata: Any = None,
                 attn_mask: Any = None, scale: float | None = None, causal: bool = False) -> torch.Tensor:
        self.calls.append({"metadata": metadata, "attn_mask": attn_mask, "shape": tuple(q.shape), "scale": scale})
        return sdpa_attention(q, k, v, metadata=metadata, scale=scale)


def test_layout_validation_names_the_problem() -> None:
    raw = fl2va_layout()
    lay = to_layout(raw)
    assert lay.used == raw["position_ids"].shape[0] and lay.seq_len % 64 == 0 and lay.seq_len >= lay.used
    with pytest.raises(ValueError, match="partition"):
        to_layout({**raw, "text_indices": raw["text_indices"][1:]})
    with pytest.raises(ValueError, match="token_tags"):
        to_layout({**raw, "token_tags": raw["token_tags"][:-1]})
    with pytest.raises(ValueError, match="num_condition_video_rows"):
        to_layout({**raw, "num_condition_video_rows": 10_000})
    with pytest.raises(ValueError, match="pad_seq_len"):
        to_layout(raw, pad_seq_len=lay.used - 1)
    assert to_layout(raw, pad_seq_len=lay.used).pad_rows == 0
    with pytest.raises(ValueError, match="position_ids"):
        RequestLayout.build(torch.zeros(4, 2), torch.zeros(4), torch.arange(4), torch.arange(0), torch.arange(0))


def test_documents_and_attention_metadata() -> None:
    spy = SpyAttention()
    dit = MiniMaxH3DiT(tiny_config(), attention=spy).eval()
    raws = [fl2va_layout(num_text=5), fl2va_layout(anchors=("first",), num_text=6)]
    xs = [request_inputs(r, dit.config, seed=i) for i, r in enumerate(raws)]
    plans = [dit.prepare_request(to_layout(r), x["text"]) for r, x in zip(raws, xs)]
    refiner_calls = len(spy.calls)
    assert refiner_calls == 2 * dit.config.num_refiner_layers  # token refiner once per request, text-only document
    assert spy.calls[0]["metadata"].cu_seqlens_q == (0, 5)
    used = [p.layout.used for p in plans]
    seq = [p.layout.seq_len for p in plans]

    single = dit.pack(plans[:1])
    ts = single.step_timesteps([0.5], [0.5])
    with torch.no_grad():
        dit(single, xs[0]["video"], xs[0]["audio"], ts.unique_timesteps, ts.inverse_indices)
    meta = spy.calls[-1]["metadata"]
    assert meta.cu_seqlens_q == (0, used[0], seq[0]) and meta.valid_kv_length == used[0]
    assert len(spy.calls) == refiner_calls + dit.config.num_layers  # one call per block, no refiner per step

    pair = dit.pack(plans)
    assert pair.total == sum(seq) and pair.offsets == (0, seq[0], seq[0] + seq[1])
    ts = pair.step_timesteps([0.5, 0.2], [0.5, 0.1])
    with torch.no_grad():
        dit(pair, torch.cat([x["video"] for x in xs]), torch.cat([x["audio"] for x in xs]), ts.unique_timesteps,
            ts.inverse_indices)
    meta = spy.calls[-1]["metadata"]
    assert meta.cu_seqlens_q == (0, used[0], seq[0], seq[0] + used[1], seq[0] + seq[1])
    assert meta.valid_kv_length is None and meta.max_seqlen_q == max(used)
    assert all(c["attn_mask"] is None for c in spy.calls)
    assert spy.calls[-1]["shape"] == (pair.total, dit.config.num_attention_heads, dit.config.attention_head_dim)


def test_row_timesteps_of_a_packed_pair() -> None:
    dit = MiniMaxH3DiT(tiny_config()).eval()
    raws = [fl2va_layout(num_text=5), fl2va_layout(anchors=("first",), num_text=6)]
    xs = [request_inputs(r, dit.config, seed=i) for i, r in enumerate(raws)]
    pair = dit.pack([dit.prepare_request(to_layout(r), x["text"]) for r, x in zip(raws, xs)])
    rows = pair.row_timesteps([0.5, 0.2], [0.25, 0.125])
    o = pair.offsets[1]
    lay0, lay1 = (p.layout for p in pair.requests)
    assert set(rows[: o].tolist()) == {0.5, 0.25}  # request 0: text/video/pad at t_v, audio at t_a
    assert rows[lay0.audio_indices].eq(0.25).all() and rows[o + lay1.audio_indices].eq(0.125).all()
    cond = o + lay1.video_indices[: lay1.num_condition_video_rows]
    assert rows[cond].eq(torch.tensor(0.999)).all()
    assert rows[o + lay1.used:].eq(0.2).all()  # request 1's pad rows follow its own video timestep
    ts = pair.step_timesteps([0.5, 0.2], [0.25, 0.125])
    assert torch.equal(ts.unique_timesteps[ts.inverse_indices], rows)


def test_latent_grid_reaches_the_attention_metadata() -> None:
    """The generated video's token grid (what the NPU RainFusion planner reads) is published on the DiT's
    metadata when the batch's requests share it; a grid that does not describe the last real rows is refused."""
    spy = SpyAttention()
    dit = MiniMaxH3DiT(tiny_config(), attention=spy).eval()
    raws = [fl2va_layout(num_text=5), fl2va_layout(anchors=("first",), num_text=6), fl2va_layout(frames=2)]
    grids = [(3, 2, 3), (3, 2, 3), (2, 2, 3)]  # latent frames, latent 4x6 over the (1, 2, 2) patch
    layouts = [to_layout(r).with_latent_grid(g) for r, g in zip(raws, grids)]
    assert layouts[1].latent_grid == (3, 2, 3)
    with pytest.raises(ValueError, match="latent_grid"):
        to_layout(raws[0]).with_latent_grid((3, 3, 2 + 1))
    with pytest.raises(ValueError, match="latent_grid"):
        to_layout(raws[1]).with_latent_grid((4, 2, 3))  # would take in the conditioning frame's rows
    xs = [request_inputs(r, dit.config, seed=i) for i, r in enumerate(raws)]
    plans = [dit.prepare_request(lay, x["text"]) for lay, x in zip(layouts, xs)]
    assert spy.calls[-1]["metadata"].latent_grid is None  # the token refiner's text-only documents
    assert dit.pack(plans[:1]).docs.metadata.latent_grid == (3, 2, 3)
    assert dit.pack(plans[:2]).docs.metadata.latent_grid == (3, 2, 3)
    assert dit.pack([plans[0], plans[2]]).docs.metadata.latent_grid is None  # no one grid for the batch
    single = dit.pack(plans[:1])
    ts = single.step_timesteps([0.5], [0.5])
    with torch.no_grad():
        dit(single, xs[0]["video"], xs[0]["audio"], ts.unique_timesteps, ts.inverse_indices)
    assert spy.calls[-1]["metadata"].latent_grid == (3, 2, 3)
