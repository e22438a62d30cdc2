"""DiT forward metadata built once per request branch and reused every step.

Model level: a reused :class:`ForwardMetadata` gives bit-identical outputs to rebuilding it, for dense and MoE,
single and packed batch CFG, right- and interior-padded masks and padded packing; its parts agree with independent
computations; it is rejected (host-side) when shapes change, and the mask's contents are not re-read per call.
Pipeline level: reuse on vs off is bit-identical in every CFG mode, TI2V, the MoE preset and its refiner stage;
metadata is built once per branch, rebuilt when the batch's text or latent shape changes, and bounded to the live
branches of the current stage.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from _lingbot_helpers import load, request, run
from omni_lingbot.presets import TINY_DIT, TINY_MOE
from omni_lingbot.transformer.config import LingBotTransformerConfig
from omni_lingbot.transformer.model import LingBotVideoTransformer3DModel
from omni_lingbot.transformer.rope import sample_positions
from PIL import Image


def _model(raw: dict) -> LingBotVideoTransformer3DModel:
    torch.manual_seed(0)
    model = LingBotVideoTransformer3DModel(LingBotTransformerConfig.from_dict(raw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if name.split(".")[-2].startswith("norm") else 0.0, 0.2)
    return model.eval()


@pytest.fixture(params=["dense", "moe"], scope="module")
def model(request):
    return _model(TINY_DIT if request.param == "dense" else TINY_MOE)


def _mask(rows: list[list[int]], length: int) -> torch.Tensor:
    """A [B, length] mask whose row i is True exactly at the listed token indices."""
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, idx in enumerate(rows):
        mask[i, idx] = True
    return mask


# name -> (batch, text length, mask rows or None, pad_to_multiple)
LAYOUTS = {
    "single_unmasked": (1, 6, None, 1),
    "single_right_padded": (1, 9, [[0, 1, 2, 3, 4]], 1),
    "batch_cfg_pair": (2, 7, [list(range(7)), [0, 1, 2]], 1),
    "batch_of_three_interior_padding": (3, 8, [list(range(8)), [1, 2, 5], [0, 7]], 1),
    "batch_cfg_padded_packing": (2, 7, [list(range(7)), [0, 1, 2, 3]], 32),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@torch.no_grad()
def test_reused_metadata_is_bit_identical_over_steps(model, name):
    b, length, rows, pad = LAYOUTS[name]
    g = torch.Generator().manual_seed(5)
    text = torch.randn(b, length, 32, generator=g)
    mask = None if rows is None else _mask(rows, length)
    x = torch.randn(b, 4, 2, 4, 6, generator=g)
    metadata = model.forward_metadata(x, text, mask, pad_to_multiple=pad)
    for step, sigma in enumerate((0.95, 0.6, 0.2)):  # new latents and timestep every step, as in a denoise loop
        x = x * (1 - sigma) + torch.randn(x.shape, generator=g) * sigma
        t = torch.full((b,), sigma * 1000)
        fresh = model(x, t, text, mask, pad_to_multiple=pad)
        reused = model(x, t, text, mask, metadata=metadata)
        assert torch.equal(fresh, reused), f"step {step}"


@torch.no_grad()
def test_metadata_parts_match_independent_computations(model):
    b, length = 3, 8
    mask = _mask([list(range(8)), [1, 2, 5], [0, 7]], length)
    text = torch.randn(b, length, 32)
    x = torch.randn(b, 4, 2, 4, 6)
    md = model.forward_metadata(x, text, mask, pad_to_multiple=16)
    grid, n_video = (2, 2, 3), 12
    lengths = [8, 3, 2]
    assert md.layout.grid == grid and md.layout.text_lengths == tuple(lengths)
    bounds = np.cumsum([0] + [n_video + n for n in lengths]).tolist()  # [0, 20, 35, 49]
    attention = md.layout.attention  # the padding is a trailing [real | pad] document, keys past 49 excluded
    assert attention.cu_seqlens_q == (*bounds, 64) and attention.valid_kv_length == 49
    assert attention.max_seqlen_q == attention.max_seqlen_k == n_video + 8
    assert md.layout.segments == tuple(itertools.pairwise(bounds))
    assert md.layout.total == 64 and md.layout.token_mask.tolist() == [True] * 49 + [False] * 15
    positions = torch.cat([sample_positions(grid, n) for n in lengths] + [torch.zeros(15, 3, dtype=torch.long)])
    assert torch.equal(md.layout.positions, positions)
    assert torch.equal(md.freqs, model.rope(positions))
    assert torch.equal(md.real_text(text), text[mask])  # the boolean-mask gather, row-major
    assert md.nbytes == (md.freqs.numel() * 8 + md.text_rows.numel() * 8 + 64 * 3 * 8 + 64)


def test_all_real_mask_needs_no_text_index(model):
    x, text = torch.randn(2, 4, 1, 4, 4), torch.randn(2, 5, 32)
    assert model.forward_metadata(x, text, torch.ones(2, 5, dtype=torch.bool)).text_rows is None
    assert model.forward_metadata(x, text, None).text_rows is None


@pytest.mark.parametrize(("change", "gist"), [
    ("frames", "latent shape"), ("height", "latent shape"), ("batch", "latent shape"),
    ("text_len", "text batch shape"), ("pad", "pad_to_multiple"),
])
@torch.no_grad()
def test_metadata_for_other_shapes_is_rejected(model, change, gist):
    x, text = torch.randn(2, 4, 2, 4, 6), torch.randn(2, 7, 32)
    mask = _mask([list(range(7)), [0, 1]], 7)
    md = model.forward_metadata(x, text, mask)
    t = torch.full((2,), 500.0)
    pad = None
    if change == "frames":
        x = torch.randn(2, 4, 3, 4, 6)
    elif change == "height":
        x = torch.randn(2, 4, 2, 6, 6)
    elif change == "batch":
        x, text, mask, t = x[:1], text[:1], mask[:1], t[:1]
    elif change == "text_len":
        text, mask = torch.randn(2, 9, 32), _mask([list(range(9)), [0, 1]], 9)
    else:
        pad = 8
    assert not md.matches(x, text, pad)
    with pytest.raises(ValueError, match=f"metadata was built for other inputs: {gist}"):
        model(x, t, text, mask, pad_to_multiple=pad, metadata=md)


@torch.no_grad()
def test_mask_contents_are_not_reread_when_metadata_is_given(model):
    """The per-step path reads no device data to check the record: a different mask of the same shape is
    ignored and the record's mask wins (which is why a record must only be used with its own mask)."""
    x, text, t = torch.randn(2, 4, 2, 4, 6), torch.randn(2, 7, 32), torch.full((2,), 300.0)
    built_for = _mask([list(range(7)), [0, 1, 2]], 7)
    other = _mask([list(range(7)), [0]], 7)
    md = model.forward_metadata(x, text, built_for)
    assert torch.equal(model(x, t, text, other, metadata=md), model(x, t, text, built_for))
    assert not torch.equal(model(x, t, text, other), model(x, t, text, built_for))


# ---------------------------------------------------------------------------------------------- pipeline


def _image() -> Image.Image:
    return Image.fromarray(np.random.default_rng(3).integers(0, 256, (24, 40, 3), dtype=np.uint8))


def _run_both(pipe: Any, monkeypatch: pytest.MonkeyPatch, *requests: Any) -> tuple[Any, Any]:
    """The same batch with metadata reuse on and off: (final state, outputs) of each."""
    on = run(pipe, *requests)
    with monkeypatch.context() as m:
        m.setattr(pipe, "reuse_forward_metadata", False)
        off = run(pipe, *requests)
    return on, off


def _assert_identical(on: Any, off: Any) -> None:
    (state_on, outs_on), (state_off, outs_off) = on, off
    assert torch.equal(state_on.latents, state_off.latents)
    for a, b in zip(outs_on, outs_off, strict=True):
        assert np.array_equal(a.frames, b.frames)


PIPELINE_CASES = {
    "no_cfg": {"guidance_scale": 1.0},
    "sequential_cfg": {"guidance_scale": 3.0},
    "batch_cfg": {"guidance_scale": 3.0, "extra": {"batch_cfg": True}},
    "ti2v_batch_cfg": {"guidance_scale": 3.0, "images": [_image()], "extra": {"batch_cfg": True}},
    "ti2v_sequential_cfg": {"guidance_scale": 3.0, "images": [_image()]},
    "t2i": {"guidance_scale": 2.0, "modalities": ("image",)},
}


@pytest.mark.parametrize("case", list(PIPELINE_CASES))
def test_pipeline_reuse_is_bit_identical(pipe, monkeypatch, case):
    kwargs = PIPELINE_CASES[case]
    # two requests with prompts of different lengths: packed documents of unequal size in every branch
    reqs = [request("a red fox", seed=3, **kwargs),
            request("a small blue bird sings on a long branch in the rain", seed=4, **kwargs)]
    on, off = _run_both(pipe, monkeypatch, *reqs)
    _assert_identical(on, off)
    built = on[0].extras["forward_metadata"]
    assert built and all(md.device == pipe.device for md in built.values())
    assert "forward_metadata" not in off[0].extras or not off[0].extras["forward_metadata"]


def test_moe_preset_and_refiner_stage_reuse_is_bit_identical(tiny_moe_dir, monkeypatch):
    moe = load(tiny_moe_dir)
    reqs = [request("a red fox", seed=3, extra={"batch_cfg": True, "run_refiner": True, "refiner_height": 64,
                                                  "refiner_width": 96, "refiner_guidance_scale": 2.0,
                                                  "refiner_batch_cfg": True})]
    on, off = _run_both(moe, monkeypatch, *reqs)
    _assert_identical(on, off)
    # after the stage switch only the refiner's branch is kept: the base stage's records went with its text
    assert set(on[0].extras["forward_metadata"]) == {"refiner.cfg"}


@pytest.fixture
def builds(pipe: Any) -> Any:
    """Counts ``forward_metadata`` calls on the pipeline's DiT (the branch's latent batch of each)."""
    model = pipe.transformer
    original = model.forward_metadata
    calls: list[int] = []

    def counting(hidden_states, *args, **kwargs):
        calls.append(hidden_states.shape[0])
        return original(hidden_states, *args, **kwargs)

    model.forward_metadata = counting
    try:
        yield calls
    finally:
        del model.forward_metadata


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({"guidance_scale": 1.0}, [1]), ({"guidance_scale": 2.0}, [1, 1]),
    ({"guidance_scale": 2.0, "extra": {"batch_cfg": True}}, [2]),
])
def test_built_once_per_branch_not_per_step(pipe, builds, kwargs, expected):
    state, _ = run(pipe, request(num_inference_steps=4, **kwargs))
    assert state.num_steps == 4
    assert builds == expected
    assert len(state.extras["forward_metadata"]) == len(expected)  # bounded by the live branches


def test_rebuilt_when_the_batch_text_changes(pipe, builds, monkeypatch):
    """Dropping a request changes the batch and the padded text length: the records are rebuilt for the
    survivors (and the result equals a run that rebuilds every step)."""
    def cancel_after_two(reuse: bool) -> Any:
        with monkeypatch.context() as m:
            m.setattr(pipe, "reuse_forward_metadata", reuse)
            long = request("a small blue bird sings on a long branch in the rain", seed=1)
            short = request("a fox", seed=2)
            state = pipe.encode([pipe.preprocess(long), pipe.preprocess(short)])
            for step in range(2):
                state = pipe.denoise_step(state, step)
            before = dict(state.extras.get("forward_metadata", {}))
            state = pipe.select_requests(state, [1])
            for step in range(2, state.num_steps):
                state = pipe.denoise_step(state, step)
            return state, before

    state, before = cancel_after_two(True)
    assert builds == [2, 2, 1, 1]  # cond + uncond for two requests, then again for the survivor
    after = state.extras["forward_metadata"]
    short_len = state.extras["cond"][1].shape[1]
    assert after["cond"].layout.text_lengths == (short_len,)
    assert before["cond"].layout.text_lengths[1] == short_len < before["cond"].layout.text_lengths[0]
    reference, _ = cancel_after_two(False)
    assert torch.equal(state.latents, reference.latents)


def test_stale_record_of_another_latent_shape_is_rebuilt(pipe, builds):
    """A record whose host-side key no longer fits (here: latents of another size) is replaced, not used."""
    state = pipe.encode([pipe.preprocess(request(guidance_scale=1.0))])
    fresh = pipe.predict(state, 0)
    assert builds == [1]
    stale = pipe.transformer.forward_metadata(torch.zeros(1, 4, 2, 8, 8), *state.extras["cond"])
    state.extras["forward_metadata"]["cond"] = stale
    assert torch.equal(pipe.predict(state, 0), fresh)
    assert builds == [1, 1, 1]
    assert state.extras["forward_metadata"]["cond"] is not stale


def test_rebuilt_when_text_lengths_change_under_the_same_shapes(pipe, monkeypatch):
    """Reordering the batch keeps every tensor shape but swaps the documents' text lengths: the host-side shape
    key cannot see that, so the records must go with the old text (``_set_text``), not survive the change."""
    def reordered(reuse: bool) -> Any:
        with monkeypatch.context() as m:
            m.setattr(pipe, "reuse_forward_metadata", reuse)
            reqs = [request("a small blue bird sings on a long branch in the rain", seed=1),
                    request("a fox", seed=2)]
            state = pipe.encode([pipe.preprocess(r) for r in reqs])
            state = pipe.denoise_step(state, 0)
            lengths = state.extras.get("forward_metadata", {}).get("cond")
            state = pipe.select_requests(state, [1, 0])
            for step in range(1, state.num_steps):
                state = pipe.denoise_step(state, step)
            return state, lengths

    state, before = reordered(True)
    after = state.extras["forward_metadata"]["cond"].layout.text_lengths
    assert after == before.layout.text_lengths[::-1] and after[0] < after[1]
    reference, _ = reordered(False)
    assert torch.equal(state.latents, reference.latents)
