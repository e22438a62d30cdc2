"""TeaCache on MiniMax-H3 reuses the cached *block residual*, as the reference does (its 0.17 threshold was
calibrated for that): a computed step keeps what the transformer blocks added (output minus embedded input); a
reused step embeds its own latents, adds that residual and runs only the final layer at its own timesteps. It used
to replay the whole previous velocity. Steps that compute are unchanged."""

from __future__ import annotations

import copy

import torch
from _h3_helpers import request
from omnicore.cache.teacache import TeaCacheConfig, apply_teacache
from omnicore.config import Settings
from omnicore.plugin_host.host import PluginHost


def _blocks(dit, state, step):
    """By hand: the step's embedded input ``x`` and its output ``h`` after every block."""
    ex = state.extras
    ts, batch = ex["steps"][step], ex["batch"]
    x = dit.embed(batch, *state.latents)
    rows = ts.inverse_indices * 3 + batch.tags
    h = x
    for block in dit.blocks:
        h = block(h, ex["t_embs"][step], rows, batch.docs, dit.attention, dit.ops, (batch.cos, batch.sin))
    return x, h


def _head(dit, state, step, hidden):
    """By hand: the final layer on ``hidden`` at the step's timesteps -> velocity rows (video, audio)."""
    ex = state.extras
    batch, final = ex["batch"], dit.final_layer
    ts = ex["steps"][step]
    t_emb = ex["t_embs"][step] if "t_embs" in ex else dit.time_embed(ts.unique_timesteps)
    inverse = ts.inverse_indices
    v = final(hidden.index_select(0, batch.video_index), t_emb, inverse.index_select(0, batch.video_index), dit.ops,
              final.video_out)
    a = final(hidden.index_select(0, batch.audio_index), t_emb, inverse.index_select(0, batch.audio_index), dit.ops,
              final.audio_out)
    return v.float(), a.float()


def _steps(pipe, host, state, steps):
    for step in steps:
        state = host.pm.hook.omnicore_denoise(pipeline=pipe, state=state, step=step)
    return state


def test_a_reused_step_applies_the_cached_block_residual(pipe):
    host = PluginHost(Settings(), autoload=False)
    pipe.host = host
    handle = apply_teacache(pipe, TeaCacheConfig(force_hits=frozenset({2})))
    try:
        assert handle.adapter.reuses_block_residual
        dit = pipe.transformer
        state = _steps(pipe, host, pipe.encode([pipe.preprocess(request(num_inference_steps=4))]), [0])
        x1, h1 = _blocks(dit, state, 1)
        v1 = _head(dit, state, 1, h1)
        state = _steps(pipe, host, state, [1])  # computed: keeps the residual of its blocks
        residual = state.extras["teacache_block_residual"]
        torch.testing.assert_close(residual, h1 - x1, rtol=0, atol=0)
        for got, want in zip(state.last_prediction, v1):
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # the forward itself is unchanged
        before = copy.copy(state)
        expected_v = _head(dit, before, 2, dit.embed(before.extras["batch"], *before.latents) + residual)
        expected = pipe.update(copy.copy(before), 2, expected_v).latents
        replayed = pipe.update(copy.copy(before), 2, before.last_prediction).latents  # the old velocity replay
        state = _steps(pipe, host, state, [2])  # reused
        assert handle.stats(state).reused == [2]
        for ours, want, old in zip(state.latents, expected, replayed):
            torch.testing.assert_close(ours, want, rtol=0, atol=0)
            assert not torch.equal(ours, old)  # not step 1's velocity again
        state = _steps(pipe, host, state, [3])
        assert handle.stats(state).computed == [0, 1, 3]
    finally:
        handle.remove()
        pipe.host = None


def test_computed_steps_are_unchanged_by_the_residual_bookkeeping(pipe):
    req = request(num_inference_steps=4)
    plain = pipe.encode([pipe.preprocess(req)])
    for step in range(plain.num_steps):
        plain = pipe.denoise_step(plain, step)
    host = PluginHost(Settings(), autoload=False)
    pipe.host = host
    handle = apply_teacache(pipe, TeaCacheConfig(force_hits=frozenset()))  # never reuse: every step keeps
    try:
        state = _steps(pipe, host, pipe.encode([pipe.preprocess(req)]), range(4))
        assert handle.stats(state).computed == [0, 1, 2, 3] and not handle.stats(state).reused
        assert state.extras["teacache_block_residual"].shape == (state.extras["batch"].total,
                                                                 pipe.transformer.config.hidden_size)
    finally:
        handle.remove()
        pipe.host = None
    for a, b in zip(state.latents, plain.latents):
        assert torch.equal(a, b)


def test_dropping_a_cancelled_request_keeps_the_survivors_residual_rows(pipe):
    a, b = request(seed=3, num_inference_steps=4), request(seed=4, num_inference_steps=4, extra={"aspect_ratio": "1:1"})
    host = PluginHost(Settings(), autoload=False)
    pipe.host = host
    handle = apply_teacache(pipe, TeaCacheConfig(force_hits=frozenset({2})))
    try:
        state = _steps(pipe, host, pipe.encode([pipe.preprocess(a), pipe.preprocess(b)]), [0, 1])
        residual, offsets = state.extras["teacache_block_residual"], state.extras["batch"].offsets
        state = pipe.select_requests(state, [1])
        torch.testing.assert_close(state.extras["teacache_block_residual"], residual[offsets[1]:offsets[2]],
                                   rtol=0, atol=0)
        before = copy.copy(state)
        want = _head(pipe.transformer, before, 2,
                     pipe.transformer.embed(before.extras["batch"], *before.latents) +
                     state.extras["teacache_block_residual"])
        state = _steps(pipe, host, state, [2])  # reused on the re-packed batch
        assert handle.stats(state).reused == [2]
        for got, exp in zip(state.last_prediction, want):
            torch.testing.assert_close(got, exp, rtol=0, atol=0)
    finally:
        handle.remove()
        pipe.host = None


def test_the_block_residual_hook_comes_in_pairs():
    import pytest
    from omnicore.cache.teacache import TeaCacheAdapter
    from omnicore.errors import ConfigError

    with pytest.raises(ConfigError, match="keep_residual and reuse_residual go together"):
        TeaCacheAdapter(extract=lambda s, i: None, keep_residual=lambda s, i: None)
    assert not TeaCacheAdapter(extract=lambda s, i: None).reuses_block_residual  # the generic velocity replay


def test_a_request_leaving_the_batch_restarts_the_comparison_instead_of_failing(pipe):
    """Cancelling one request of a packed batch re-packs it: the next step's modulated input has other rows than
    the last one, so it computes (and the comparison restarts) — it raised a size mismatch and failed the batch."""
    a, b = request(seed=3, num_inference_steps=5), request(seed=4, num_inference_steps=5, extra={"aspect_ratio": "1:1"})
    host = PluginHost(Settings(), autoload=False)
    pipe.host = host
    handle = apply_teacache(pipe, TeaCacheConfig(rel_l1_thresh=1e9))
    try:
        state = _steps(pipe, host, pipe.encode([pipe.preprocess(a), pipe.preprocess(b)]), [0, 1])
        assert handle.stats(state).reused == [1]
        state = _steps(pipe, host, pipe.select_requests(state, [1]), [2, 3, 4])
        assert handle.stats(state).computed == [0, 2, 4] and handle.stats(state).reused == [1, 3]
        (out,) = pipe.decode(state)
        assert out.seed == 4 and out.frames.shape == (107, 64, 64, 3)
    finally:
        handle.remove()
        pipe.host = None
