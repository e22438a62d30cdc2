"""Parity of our serving DiT with diffusers' ``MiniMaxH3Transformer3DModel`` on identical weights (fp32).

The diffusers model is saved with ``save_pretrained`` and loaded by our loader; layouts come from diffusers' own
layout builders; per-row timesteps from its ``build_row_timesteps``. Our forward packs ``[real | pad]`` (pad to
64) and, for the batch case, two requests in one forward; diffusers runs each request alone, unpadded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dit_helpers import (
    build_reference,
    fl2va_layout,
    ref2va_layout,
    reference_forward,
    request_inputs,
    row_timesteps,
    save_reference,
    tiny_config,
    to_layout,
)
from omni_minimax_h3.loader import load_transformer

TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    config = tiny_config()
    ref = build_reference(config, seed=3)
    path = save_reference(ref, tmp_path_factory.mktemp("h3-dit") / "transformer")
    return ref, load_transformer(path)


LAYOUTS = {
    "t2va": lambda: fl2va_layout(),
    "fl2va": lambda: fl2va_layout(anchors=("first", "last"), vision=(2, 6), num_text=10),
    "ref2va": lambda: ref2va_layout(),
}
# (t_video, t_audio) per step: fl2va's conditioning rows pin 0.999, ref2va's reference audio 1.0, so a step has
# up to four distinct timesteps.
STEPS = [(0.0, 0.0), (0.25, 0.6), (0.9995, 0.5)]


def _ours(dit: Any, raws: list[dict[str, Any]], inputs: list[dict[str, torch.Tensor]],
          t_video: list[float], t_audio: list[float]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    plans = [dit.prepare_request(to_layout(r), x["text"]) for r, x in zip(raws, inputs)]
    batch = dit.pack(plans)
    ts = batch.step_timesteps(t_video, t_audio)
    with torch.no_grad():
        v, a = dit(batch, torch.cat([x["video"] for x in inputs]), torch.cat([x["audio"] for x in inputs]),
                   ts.unique_timesteps, ts.inverse_indices)
    return batch.split_video(v), batch.split_audio(a)


@pytest.mark.parametrize("task", sorted(LAYOUTS))
@pytest.mark.parametrize("step", range(len(STEPS)))
def test_single_request_matches_diffusers(models: tuple[Any, Any], task: str, step: int) -> None:
    ref, dit = models
    raw = LAYOUTS[task]()
    x = request_inputs(raw, dit.config, seed=step)
    tv, ta = STEPS[step]
    unique, inverse = row_timesteps(raw, tv, ta)
    want_v, want_a = reference_forward(ref, raw, x, unique, inverse)
    (got_v,), (got_a,) = _ours(dit, [raw], [x], [tv], [ta])
    assert got_v.shape == want_v.shape and got_a.shape == want_a.shape
    assert want_v.abs().max() > 0.1  # the comparison is not between near-zero tensors
    assert (got_v - want_v).abs().max().item() <= TOL
    assert (got_a - want_a).abs().max().item() <= TOL


@pytest.mark.parametrize("task", sorted(LAYOUTS))
def test_step_timesteps_bit_identical_to_diffusers(models: tuple[Any, Any], task: str) -> None:
    """Our host-side reduction == diffusers' unique over per-row timesteps (values, bits, inverse), every step;
    a mid step has several distinct timesteps (video, audio, conditioning video 0.999, reference audio 1.0)."""
    _, dit = models
    raw = LAYOUTS[task]()
    layout = to_layout(raw)
    batch = dit.pack([dit.prepare_request(layout, request_inputs(raw, dit.config, 0)["text"])])
    want_unique_count = {"t2va": 2, "fl2va": 3, "ref2va": 4}[task]
    for tv, ta in STEPS:
        unique, inverse = row_timesteps(raw, tv, ta)
        ts = batch.step_timesteps([tv], [ta])
        assert torch.equal(ts.unique_timesteps.view(torch.int32), unique.view(torch.int32))
        assert ts.timestep_bits == tuple(unique.view(torch.int32).tolist())
        assert torch.equal(ts.inverse_indices[: layout.used], inverse)
        assert torch.equal(batch.row_timesteps([tv], [ta])[: layout.used], unique[inverse])
    assert batch.step_timesteps([0.25], [0.6]).unique_timesteps.numel() == want_unique_count


def test_two_requests_packed_match_each_alone(models: tuple[Any, Any]) -> None:
    """A t2va and an fl2va request at different steps, packed in one forward == diffusers on each."""
    ref, dit = models
    raws = [fl2va_layout(num_text=5, frames=2), fl2va_layout(anchors=("first", "last"), num_text=8, vision=(1, 4))]
    xs = [request_inputs(r, dit.config, seed=10 + i) for i, r in enumerate(raws)]
    tvs, tas = [0.3, 0.7], [0.55, 0.1]
    got_v, got_a = _ours(dit, raws, xs, tvs, tas)
    for raw, x, tv, ta, gv, ga in zip(raws, xs, tvs, tas, got_v, got_a):
        want_v, want_a = reference_forward(ref, raw, x, *row_timesteps(raw, tv, ta))
        assert (gv - want_v).abs().max().item() <= TOL
        assert (ga - want_a).abs().max().item() <= TOL


def test_padding_does_not_change_real_rows(models: tuple[Any, Any]) -> None:
    _, dit = models
    raw = fl2va_layout(anchors=("first",))
    x = request_inputs(raw, dit.config, seed=5)
    outs = []
    for align in (1, 64, 256):
        plan = dit.prepare_request(to_layout(raw, seq_align=align), x["text"])
        batch = dit.pack([plan])
        ts = batch.step_timesteps([0.4], [0.2])
        with torch.no_grad():
            outs.append(dit(batch, x["video"], x["audio"], ts.unique_timesteps, ts.inverse_indices))
    assert batch.total == 256 and outs[0][0].shape[0] == raw["video_indices"].numel()
    for v, a in outs[1:]:
        assert (v - outs[0][0]).abs().max().item() <= TOL
        assert (a - outs[0][1]).abs().max().item() <= TOL
