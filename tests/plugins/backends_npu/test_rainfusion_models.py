"""RainFusion takes effect (issue 19 item 2): LingBot and MiniMax-H3 attach a block-sparse plan for their latent grid
when the attention backend executes plans (``npu_rainfusion``, here on the CPU op seam), with the sparsity and the
exempt layers from their deployment options; LingBot's video-first documents are rotated exactly; the plan is the
sequence-global one under Ulysses (every rank attends over all rows for H / P heads) and ring attention is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from _npu_helpers import OPS, npu_rainfusion_on_cpu
from omni_backends_npu.attention import npu_rainfusion_attention
from omni_backends_npu.rainfusion import RainFusion, RainFusionConfig, build_plan, ulysses_plan
from omnicore.attention.metadata import AttentionMetadata
from omnicore.attention.reference import sdpa_attention
from omnicore.engine.protocol import LoadOptions
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.errors import ConfigError
from omnicore.platforms.cpu import CpuPlatform


class Switch:
    """The attention handed to the model: npu_rainfusion (CPU seam) or sdpa, chosen per run; it carries the
    planner factory, so the model attaches plans either way (sdpa ignores them)."""

    sparse_planner = staticmethod(npu_rainfusion_on_cpu.sparse_planner)

    def __init__(self) -> None:
        self.backend: Any = npu_rainfusion_on_cpu

    def select(self, requirement: Any) -> Any:
        return self

    def __call__(self, q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
        return self.backend(q, k, v, **kwargs)


def _sparse_calls() -> list[Any]:
    calls = [c for c in OPS.calls if c.op == "sparse_attention"]
    OPS.calls.clear()
    return calls


# ---------------------------------------------------------------------------------------------- host logic
def test_a_video_first_document_is_rotated_exactly() -> None:
    """[video | text] through a video_first plan == [text | video] through the plain plan, rotated back."""
    g = torch.Generator().manual_seed(0)
    grid, prefix, heads = (2, 16, 16), 40, 2
    video = grid[0] * grid[1] * grid[2]
    q, k, v = (torch.randn(prefix + video + 6, heads, 16, generator=g) for _ in range(3))  # 6 padding rows
    used = prefix + video
    meta = AttentionMetadata(cu_seqlens_q=(0, used, used + 6), valid_kv_length=used, latent_grid=grid)
    last = attrs_evolve(meta, build_plan(prefix, grid, sparsity=0.5))
    first = attrs_evolve(meta, build_plan(prefix, grid, sparsity=0.5, video_first=True))

    def rot(t: torch.Tensor) -> torch.Tensor:  # [text | video | pad] -> [video | text | pad]
        return torch.cat([t[prefix:used], t[:prefix], t[used:]])

    with_prefix = npu_rainfusion_on_cpu(q, k, v, metadata=last)
    with_video_first = npu_rainfusion_on_cpu(rot(q), rot(k), rot(v), metadata=first)
    calls = _sparse_calls()
    assert len(calls) == 2 and calls[1].kwargs["plan"].video_first
    assert torch.equal(calls[0].query, calls[1].query)  # the kernel saw the same [prefix | video] rows
    torch.testing.assert_close(with_video_first, rot(with_prefix), rtol=0, atol=0)
    dense = sdpa_attention(q, k, v, metadata=meta)
    assert not torch.allclose(with_prefix[:used], dense[:used], atol=1e-3)  # sparsity 0.5 really drops blocks


def attrs_evolve(meta: AttentionMetadata, plan: Any) -> AttentionMetadata:
    import attrs

    return attrs.evolve(meta, sparse_plan=plan)


def test_layer_metadata_exempts_layers_and_the_planner_reads_deployment_options() -> None:
    planner = npu_rainfusion_attention.sparse_planner({"sparsity": 0.25, "skip_layers": "0,2"})
    assert planner.config == RainFusionConfig(sparsity=0.25, skip_layers="0,2")
    meta = AttentionMetadata(cu_seqlens_q=(0, 40 + 512), latent_grid=(2, 16, 16))
    layers = planner.layer_metadata(meta, 4, video_first=True)
    assert [m.sparse_plan is None for m in layers] == [True, False, True, False]
    assert layers[1].sparse_plan.prefix_len == 40 and layers[1].sparse_plan.video_first
    assert layers[1] is layers[3]  # one plan, shared
    with pytest.raises(ConfigError, match="rainfusion.sparsity"):
        npu_rainfusion_attention.sparse_planner({"sparsity": 1.5})


def test_the_plan_is_sequence_global_under_ulysses_and_ring_is_refused() -> None:
    plan = build_plan(22, (2, 16, 16))
    for degree in (1, 2, 4):
        scaled = ulysses_plan(plan, ulysses=degree)
        assert scaled == plan and scaled.used_len == 22 + 512  # the full sequence's rows on every rank
    with pytest.raises(ConfigError, match="ring degree 1"):
        ulysses_plan(plan, ulysses=2, ring=2)


@pytest.mark.slow
def test_ulysses_two_ranks_run_the_single_process_plan_over_gloo(tmp_path: Path) -> None:
    """Two gloo ranks, Ulysses attention around npu_rainfusion with the planned full-sequence metadata: each rank's
    rf_v2 call covers all used_len rows for H / 2 heads, and the gathered output equals the single process."""
    from _rainfusion_ranks import ulysses_rank

    mp.spawn(ulysses_rank, args=(str(tmp_path / "rendezvous"),), nprocs=2, join=True)


# ---------------------------------------------------------------------------------------------- LingBot
LINGBOT = SamplingParams(height=256, width=256, num_frames=5, num_inference_steps=1, guidance_scale=2.0, seed=5)


def _lingbot_latents(pipe: Any) -> torch.Tensor:
    req = GenerationRequest("a red fox", LINGBOT, modalities=("video",), extra={"batch_cfg": False})
    state = pipe.encode([pipe.preprocess(req)])
    return pipe.denoise_step(state, 0).latents.clone()


@pytest.fixture(scope="module")
def lingbot(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Switch]:
    from omni_lingbot.pipeline import LingBotPipeline
    from omni_lingbot.presets import build_tiny_lingbot

    switch = Switch()
    path = build_tiny_lingbot(tmp_path_factory.mktemp("tiny-lingbot-rf"))
    pipe = LingBotPipeline.from_pretrained(path, LoadOptions(platform=CpuPlatform(), attention=switch.select,
                                                             model_options={"rainfusion_sparsity": 0.0}))
    return pipe, switch


@torch.no_grad()
def test_lingbot_through_npu_rainfusion_runs_a_sparse_plan_for_its_grid(lingbot: tuple[Any, Switch]) -> None:
    pipe, switch = lingbot
    dit = pipe.transformer
    assert isinstance(dit.sparse_planner, RainFusion) and dit.sparse_planner.config.sparsity == 0.0
    OPS.calls.clear()
    switch.backend = sdpa_attention
    dense = _lingbot_latents(pipe)
    switch.backend = npu_rainfusion_on_cpu
    exact = _lingbot_latents(pipe)  # sparsity 0: the rf_v2 stand-in keeps every block
    calls = _sparse_calls()
    blocks = len(dit.blocks)
    assert len(calls) == 2 * blocks  # both CFG branches, every layer
    plan = calls[0].kwargs["plan"]
    assert plan.latent_shape == (2, 16, 16) and plan.video_first and plan.sparse_blocks == 4
    assert calls[0].query.shape[1] == plan.used_len
    torch.testing.assert_close(exact, dense, atol=1e-4, rtol=1e-4)

    dit.enable_sparse_attention({"sparsity": 0.5, "skip_layers": "0"})  # what the model options configure
    sparse = _lingbot_latents(pipe)
    calls = _sparse_calls()
    assert len(calls) == 2 * (blocks - 1) and {c.kwargs["plan"].sparsity for c in calls} == {0.5}
    assert not torch.allclose(sparse, dense, atol=1e-4)


# ---------------------------------------------------------------------------------------------- MiniMax-H3
@pytest.mark.slow
@torch.no_grad()
def test_minimax_h3_through_npu_rainfusion_runs_a_sparse_plan_for_its_grid(tmp_path_factory) -> None:
    from omni_minimax_h3.pipeline import MiniMaxH3Pipeline
    from omni_minimax_h3.presets import build_tiny_fl2va

    switch = Switch()
    path = build_tiny_fl2va(tmp_path_factory.mktemp("tiny-h3-rf"))
    pipe = MiniMaxH3Pipeline.from_pretrained(path, LoadOptions(platform=CpuPlatform(), attention=switch.select,
                                                               model_options={"rainfusion_sparsity": 0.0}))
    req = GenerationRequest("rain on a tin roof", SamplingParams(num_inference_steps=1, seed=3, duration=4.0,
                                                                 height=256, width=256))

    def latents() -> Any:
        state = pipe.encode([pipe.preprocess(req)])
        return pipe.denoise_step(state, 0).latents

    OPS.calls.clear()
    switch.backend = sdpa_attention
    dense = latents()
    switch.backend = npu_rainfusion_on_cpu
    exact = latents()
    calls = _sparse_calls()
    assert calls, "no layer ran the sparse op"
    plan = calls[0].kwargs["plan"]
    assert plan.latent_shape == (32, 8, 8) and not plan.video_first and plan.prefix_len > 0
    torch.testing.assert_close(exact, dense, atol=1e-4, rtol=1e-4)  # sparsity 0: dense within fp32 tolerance
