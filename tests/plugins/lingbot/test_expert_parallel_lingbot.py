"""LingBot MoE over an expert-parallel group (``--parallel ep=2``, gloo, 2 processes): each rank keeps half of every
MoE block's routed experts, the replicated router picks the single-process top-k, token copies go to their experts'
rank and back by all-to-all (or, with ``ep_dispatch=all_reduce``, the shares are all-reduced); the video of a single
request and of a batch equals the single-process engine's. Expert counts the degree does not divide, and a dense
DiT, are refused naming the numbers. Tiny random weights: the frames are noise, compared value for value."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _lingbot_helpers import load
from omnicore.engine.api import Engine, make_request
from omnicore.errors import ConfigError

SMALL = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 3.0}
PROMPTS = ("a red fox", "a blue bird in the snow")


def _engine(path: Path, parallel: str | None = None, **options: Any) -> Engine:
    from omnicore.plugin_host.host import default_host

    settings = default_host().settings.evolve(request_batch_max_wait_ms=400.0)  # lets two submits form a batch
    return Engine(str(path), settings=settings, parallel=parallel, model_options=options or None)


def _frames(engine: Engine, *prompts: str, seed: int = 11) -> list[np.ndarray]:
    jobs = [engine.submit(make_request(p, seed=seed + i, **SMALL)) for i, p in enumerate(prompts)]
    outputs = [job.result(600)[0] for job in jobs]
    assert {o.metrics["batch_requests"] for o in outputs} == {len(prompts)}
    return [o.frames for o in outputs]


def _assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        assert np.abs(g.astype(int) - e.astype(int)).max() <= 1  # fp32 reassociation: one uint8 level at most


def test_expert_counts_the_degree_does_not_divide_and_dense_dits_are_refused(tiny_moe_dir: Path,
                                                                            tiny_dir: Path) -> None:
    moe = load(tiny_moe_dir).transformer
    experts = moe.config.num_experts  # 4 in the tiny preset
    with pytest.raises(ConfigError, match=rf"ep=3 must divide the model's routed experts \({experts}\)"):
        moe.enable_expert_parallel(SimpleNamespace(ep=3, ep_rank=0))
    with pytest.raises(ConfigError, match="ep_dispatch"):
        moe.enable_expert_parallel(SimpleNamespace(ep=2, ep_rank=0), dispatch="broadcast")
    with pytest.raises(ConfigError, match="ep=2 needs a mixture-of-experts DiT"):
        load(tiny_dir).transformer.enable_expert_parallel(SimpleNamespace(ep=2, ep_rank=0))


@pytest.mark.slow
@pytest.mark.parametrize("dispatch", ["all_to_all", "all_reduce"])
def test_expert_parallel_video_matches_single_process(tiny_moe_dir: Path, dispatch: str) -> None:
    with _engine(tiny_moe_dir) as engine:
        reference = {"single": _frames(engine, PROMPTS[0]), "batch": _frames(engine, *PROMPTS)}
    with _engine(tiny_moe_dir, "ep=2", ep_dispatch=dispatch) as engine:
        from omni_lingbot.transformer.moe import LingBotMoE

        moes = [m for m in engine.pipeline.transformer.modules() if isinstance(m, LingBotMoE)]
        assert moes and all(m.experts.w1.shape[0] == m.experts.total // 2 and m.experts.first == 0 for m in moes)
        engine.group.ctx.stats.reset()
        _assert_same(_frames(engine, PROMPTS[0]), reference["single"])
        calls = engine.group.ctx.stats.snapshot()["calls"]
        forwards = SMALL["num_inference_steps"] * 2  # two CFG passes per step on CPU (batch_cfg auto)
        if dispatch == "all_to_all":  # rows out, ids out, rows back; then the slices' all-gather
            assert calls == {"all_to_all": 3 * len(moes) * forwards, "all_gather": len(moes) * forwards}, calls
        else:
            assert calls == {"all_reduce": len(moes) * forwards}, calls
        _assert_same(_frames(engine, *PROMPTS), reference["batch"])
