"""First-block cache: block skipping via hooks on a declared block loop, against a hand-computed reference."""

from __future__ import annotations

import pytest
import torch
from omnicore.cache import BlockLoop, FirstBlockCacheConfig, apply_first_block_cache
from omnicore.cache.teacache import relative_l1
from omnicore.engine.protocol import BasePipeline, DenoiseState
from omnicore.errors import UnsupportedFeature
from omnicore.module_hooks import HookRegistry, hook_context
from omnicore.plugin_host.host import PluginHost
from torch import nn

N = 10


class Block(nn.Module):
    def __init__(self, dim: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(dim, dim, generator=g) * 0.2)
        self.calls = 0

    def forward(self, hidden_states, context):
        self.calls += 1
        return hidden_states + torch.tanh(hidden_states @ self.w) + 0.01 * context, context * 1.5


class Model(nn.Module):
    def __init__(self, dim: int = 6, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, i) for i in range(depth))

    def forward(self, x, context):
        for block in self.blocks:
            x, context = block(x, context=context)
        return x


class Pipe(BasePipeline):
    def __init__(self, host, cfg: bool = False) -> None:
        self.host = host
        self.transformer = Model()
        self.block_loop = BlockLoop(blocks="transformer.blocks", streams=("hidden_states", "context"))
        self.cfg = cfg

    def state(self, seed: int = 0) -> DenoiseState:
        g = torch.Generator().manual_seed(seed)
        return DenoiseState(requests=[], num_steps=N, latents=torch.randn(3, 6, generator=g))

    def predict(self, state, step):
        ctx = torch.full((3, 6), 1.0 - step / N)
        if not self.cfg:
            return self.transformer(state.latents, ctx)
        with hook_context("cond"):
            cond = self.transformer(state.latents, ctx)
        with hook_context("uncond"):
            uncond = self.transformer(state.latents, torch.zeros_like(ctx))
        return uncond + 2.0 * (cond - uncond)

    def update(self, state, step, prediction):
        state.latents = state.latents + (prediction - state.latents) / N
        return state


def _run(host, pipe, state):
    for step in range(N):
        state = host.denoise(pipeline=pipe, state=state, step=step)
    return state


def _reference(pipe: Pipe, state: DenoiseState, threshold: float, forced: set[int] | None = None):
    """Hand-written FBCache over the same blocks (single branch)."""
    blocks = list(pipe.transformer.blocks)
    prev_head_res = rest = None
    reused = []
    for step in range(N):
        ctx = torch.full((3, 6), 1.0 - step / N)
        h0, c0 = blocks[0].forward(state.latents, ctx)
        res0 = h0 - state.latents
        allowed = 1 <= step < N - 1 and rest is not None
        hit = allowed and (step in forced if forced is not None else relative_l1(res0, prev_head_res) < threshold)
        if hit:
            reused.append(step)
            out = h0 + rest[0]
        else:
            h, c = h0, c0
            for b in blocks[1:]:
                h, c = b.forward(h, c)
            rest = (h - h0, c - c0)
            prev_head_res = res0
            out = h
        state.latents = state.latents + (out - state.latents) / N
    return state.latents, reused


@pytest.fixture
def host():
    return PluginHost(autoload=False)


@pytest.mark.parametrize("threshold", [1e-9, 0.05, 10.0])
def test_matches_hand_written_reference(host, threshold):
    pipe = Pipe(host)
    expected, expected_reused = _reference(pipe, pipe.state(), threshold)
    for b in pipe.transformer.blocks:
        b.calls = 0
    handle = apply_first_block_cache(pipe, FirstBlockCacheConfig(threshold=threshold))
    state = _run(host, pipe, pipe.state())
    stats = handle.stats(state)
    assert stats.reused == expected_reused
    torch.testing.assert_close(state.latents, expected, rtol=0, atol=0)
    blocks = pipe.transformer.blocks
    assert blocks[0].calls == N
    assert all(b.calls == N - len(expected_reused) for b in blocks[1:])
    if threshold == 10.0:
        assert expected_reused == list(range(1, N - 1))
    if threshold == 1e-9:
        assert expected_reused == []


def test_forced_pattern(host):
    pipe = Pipe(host)
    expected, _ = _reference(pipe, pipe.state(), 0.0, forced={0, 3, 4, N - 1})
    handle = apply_first_block_cache(pipe, FirstBlockCacheConfig(force_hits={0, 3, 4, N - 1}))
    state = _run(host, pipe, pipe.state())
    assert handle.stats(state).reused == [3, 4]
    torch.testing.assert_close(state.latents, expected, rtol=0, atol=0)


def test_cfg_branches_keep_separate_residuals(host):
    pipe = Pipe(host, cfg=True)
    apply_first_block_cache(pipe, FirstBlockCacheConfig(force_hits={2}))
    state = _run(host, pipe, pipe.state())
    # reference: the same CFG pipeline, computing each branch by hand with its own cached residual
    ref = Pipe(None, cfg=True)
    ref.transformer.load_state_dict(pipe.transformer.state_dict())
    s = ref.state()
    blocks = list(ref.transformer.blocks)
    rest: dict[str, tuple] = {}
    for step in range(N):
        outs = {}
        for name, ctx in (("cond", torch.full((3, 6), 1.0 - step / N)), ("uncond", torch.zeros(3, 6))):
            h0, c0 = blocks[0].forward(s.latents, ctx)
            if step == 2:
                outs[name] = h0 + rest[name][0]
            else:
                h, c = h0, c0
                for b in blocks[1:]:
                    h, c = b.forward(h, c)
                rest[name] = (h - h0, c - c0)
                outs[name] = h
        pred = outs["uncond"] + 2.0 * (outs["cond"] - outs["uncond"])
        s.latents = s.latents + (pred - s.latents) / N
    torch.testing.assert_close(state.latents, s.latents, rtol=0, atol=0)


def test_calls_outside_the_loop_compute_normally(host):
    pipe = Pipe(host)
    apply_first_block_cache(pipe, FirstBlockCacheConfig(threshold=1e9))
    _run(host, pipe, pipe.state())
    x, ctx = torch.randn(3, 6), torch.ones(3, 6)
    before = [b.calls for b in pipe.transformer.blocks]
    out = pipe.transformer(x, ctx)
    assert [b.calls for b in pipe.transformer.blocks] == [c + 1 for c in before]
    ref = x
    c = ctx
    for b in pipe.transformer.blocks:
        ref, c = Block.forward(b, ref, c)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_new_state_does_not_reuse_previous_batch_residuals(host):
    pipe = Pipe(host)
    handle = apply_first_block_cache(pipe, FirstBlockCacheConfig(threshold=1e9))
    _run(host, pipe, pipe.state(seed=0))
    state = pipe.state(seed=1)
    state = host.denoise(pipeline=pipe, state=state, step=0)
    state = host.denoise(pipeline=pipe, state=state, step=1)
    assert handle.stats(state).computed == [0] and handle.stats(state).reused == [1]


def test_remove_restores_blocks_and_host(host):
    pipe = Pipe(host)
    plugins = set(host.pm.get_plugins())
    ref = _run(host, pipe, pipe.state()).latents
    handle = apply_first_block_cache(pipe, FirstBlockCacheConfig(threshold=1e9))
    assert not torch.equal(_run(host, pipe, pipe.state()).latents, ref)
    handle.remove()
    assert set(host.pm.get_plugins()) == plugins
    for b in pipe.transformer.blocks:
        assert "forward" not in b.__dict__ and HookRegistry.for_module(b, create=False) is None
    torch.testing.assert_close(_run(host, pipe, pipe.state()).latents, ref, rtol=0, atol=0)


def test_needs_a_block_loop(host):
    pipe = Pipe(host)
    del pipe.block_loop
    with pytest.raises(UnsupportedFeature, match="BlockLoop"):
        apply_first_block_cache(pipe)
