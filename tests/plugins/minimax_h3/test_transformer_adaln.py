"""Exact-schedule AdaLN cache on our DiT: cached == uncached bit for bit, rebuilds on a new schedule, projection
weight offload (spilled to a file on CPU) frees exactly the projection bytes, falls back when tables >= weights."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from _dit_helpers import fl2va_layout, ref2va_layout, request_inputs, tiny_config, to_layout
from omni_minimax_h3.transformer.model import MiniMaxH3DiT
from omnicore.cache.adaln_schedule import schedule_key

SCHEDULE = [(0.0, 0.0), (0.3, 0.55), (0.8, 0.9)]


def random_dit(seed: int = 0) -> MiniMaxH3DiT:
    torch.manual_seed(seed)
    dit = MiniMaxH3DiT(tiny_config())
    with torch.no_grad():
        for p in dit.parameters():
            p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.dim() == 2 else 0.05) + (p.dim() == 1) * 1.0)
    return dit.eval()


@pytest.fixture
def setup() -> tuple[MiniMaxH3DiT, Any, list[Any], dict[str, torch.Tensor]]:
    dit = random_dit()
    raws = [fl2va_layout(anchors=("first",)), ref2va_layout()]
    xs = [request_inputs(r, dit.config, seed=i) for i, r in enumerate(raws)]
    batch = dit.pack([dit.prepare_request(to_layout(r), x["text"]) for r, x in zip(raws, xs)])
    steps = [batch.step_timesteps([tv, tv], [ta, ta]) for tv, ta in SCHEDULE]
    inputs = {"video": torch.cat([x["video"] for x in xs]), "audio": torch.cat([x["audio"] for x in xs])}
    return dit, batch, steps, inputs


def _run(dit: MiniMaxH3DiT, batch: Any, steps: list[Any], inputs: dict[str, torch.Tensor], cached: bool) -> list:
    outs = []
    with torch.no_grad():
        for i, ts in enumerate(steps):
            kw = {"adaln_step_index": i} if cached else {}
            outs.append(dit(batch, inputs["video"], inputs["audio"], ts.unique_timesteps, ts.inverse_indices, **kw))
    return outs


def _resident(dit: MiniMaxH3DiT) -> int:
    return sum(p.numel() * p.element_size() for p in dit.parameters())


def test_cached_equals_uncached_exactly_and_reuses_by_key(setup: Any) -> None:
    dit, batch, steps, inputs = setup
    plain = _run(dit, batch, steps, inputs, cached=False)
    plan, key = [s.unique_timesteps for s in steps], schedule_key(steps)
    assert max(len(s.unique_timesteps) for s in steps) == 4  # t_v, t_a, 0.999, 1.0 in one step
    cache = dit.adaln.prepare(plan, key)
    assert cache is not None and cache.steps == 3
    for (v0, a0), (v1, a1) in zip(plain, _run(dit, batch, steps, inputs, cached=True)):
        assert torch.equal(v0, v1) and torch.equal(a0, a1)
    assert dit.adaln.prepare(plan, key) is cache  # same key: same tables
    other = [batch.step_timesteps([0.1, 0.1], [0.2, 0.2])]
    rebuilt = dit.adaln.prepare([s.unique_timesteps for s in other], schedule_key(other))
    assert rebuilt is not cache and rebuilt.steps == 1
    with pytest.raises(ValueError, match="outside"):
        dit(batch, inputs["video"], inputs["audio"], other[0].unique_timesteps, other[0].inverse_indices,
            adaln_step_index=1)
    dit.adaln.clear()
    with pytest.raises(ValueError, match="without a prepared"):
        dit(batch, inputs["video"], inputs["audio"], steps[0].unique_timesteps, steps[0].inverse_indices,
            adaln_step_index=0)


def test_weight_offload_spills_projection_bytes_and_restores(setup: Any) -> None:
    dit, batch, steps, inputs = setup
    plain = _run(dit, batch, steps, inputs, cached=False)
    before = {k: v.clone() for k, v in dit.state_dict().items()}
    resident = _resident(dit)
    projections = dit.adaln_projections()
    proj_bytes = sum(p.numel() * p.element_size() for proj in projections for p in proj.parameters())
    cache = dit.adaln.prepare([s.unique_timesteps for s in steps], schedule_key(steps), offload_weights=True)
    assert cache is not None and cache.offloaded_projection_bytes == proj_bytes
    assert cache.net_memory_saved_bytes == proj_bytes - cache.table_bytes > 0
    assert _resident(dit) == resident - proj_bytes
    assert all(p.numel() == 0 for proj in projections for p in proj.parameters())
    spills = [proj._spill[0] for proj in projections]
    assert all(os.path.isfile(f) for f in spills)
    for (v0, a0), (v1, a1) in zip(plain, _run(dit, batch, steps, inputs, cached=True)):
        assert torch.equal(v0, v1) and torch.equal(a0, a1)
    dit.adaln.clear()
    after = dit.state_dict()
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert not any(os.path.exists(f) for f in spills)
    assert _run(dit, batch, steps[:1], inputs, cached=False)[0][0].equal(plain[0][0])


def test_offload_falls_back_when_tables_are_not_smaller(setup: Any) -> None:
    dit, batch, _, _ = setup
    # 40 steps x 4 unique timesteps: tables (40 * 12 rows * 6H per block) outgrow the 32 -> 18H projections
    steps = [batch.step_timesteps([i / 50, i / 50], [i / 45, i / 45]) for i in range(40)]
    resident = _resident(dit)
    assert dit.adaln.prepare([s.unique_timesteps for s in steps], schedule_key(steps), offload_weights=True) is None
    assert dit.adaln.cache is None and _resident(dit) == resident
    assert all(proj.table is None for proj in dit.adaln_projections())
    # without offload the tables are installed whatever their size
    assert dit.adaln.prepare([s.unique_timesteps for s in steps], schedule_key(steps)) is not None


def test_forward_rejects_mismatched_inputs(setup: Any) -> None:
    dit, batch, steps, inputs = setup
    ts = steps[0]
    with pytest.raises(ValueError, match="video rows"):
        dit(batch, inputs["video"][1:], inputs["audio"], ts.unique_timesteps, ts.inverse_indices)
    with pytest.raises(ValueError, match="audio rows"):
        dit(batch, inputs["video"], inputs["audio"][:, :8], ts.unique_timesteps, ts.inverse_indices)
    with pytest.raises(ValueError, match="inverse_indices"):
        dit(batch, inputs["video"], inputs["audio"], ts.unique_timesteps, ts.inverse_indices[:-1])
    with pytest.raises(ValueError, match="one video and one audio timestep per request"):
        batch.step_timesteps([0.5], [0.5])


def test_modulated_input_is_the_first_blocks_attention_input(setup: Any) -> None:
    """What TeaCache compares: equals block 0's modulated input in the real forward (captured by a hook)."""
    dit, batch, steps, inputs = setup
    ts = steps[1]
    seen: list[torch.Tensor] = []
    handle = dit.blocks[0].attn.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    try:
        with torch.no_grad():
            dit(batch, inputs["video"], inputs["audio"], ts.unique_timesteps, ts.inverse_indices)
    finally:
        handle.remove()
    got = dit.modulated_input(batch, inputs["video"], inputs["audio"], ts.unique_timesteps, ts.inverse_indices)
    assert got.shape == (batch.total, dit.config.hidden_size) and torch.equal(got, seen[0])


def test_direct_modulated_input_ignores_another_schedules_tables(setup: Any) -> None:
    """TeaCache's probe can run before this batch's schedule is prepared, while another schedule's tables are
    installed and the projection weights offloaded: ``direct=True`` still gives the uncached modulated input."""
    dit, batch, steps, inputs = setup
    ts = steps[1]
    args = (batch, inputs["video"], inputs["audio"], ts.unique_timesteps, ts.inverse_indices)
    plain = dit.modulated_input(*args)
    other = [batch.step_timesteps([0.1, 0.1], [0.2, 0.2])]
    assert dit.adaln.prepare([s.unique_timesteps for s in other], schedule_key(other), offload_weights=True)
    assert dit.blocks[0].adaln_proj.offloaded
    with pytest.raises(ValueError, match="adaln_step_index must be an int"):
        dit.modulated_input(*args)
    assert torch.equal(dit.modulated_input(*args, direct=True), plain)
    assert not dit.blocks[0].adaln_proj.offloaded  # restored to compute it


def test_schedule_embeddings_match_the_per_step_and_cached_paths(setup: Any) -> None:
    dit, batch, steps, inputs = setup
    embs = dit.schedule_embeddings([s.unique_timesteps for s in steps])
    plain = _run(dit, batch, steps, inputs, cached=False)
    with torch.no_grad():
        for k, ts in enumerate(steps):
            v, a = dit(batch, inputs["video"], inputs["audio"], ts.unique_timesteps, ts.inverse_indices,
                       time_embedding=embs[k])
            assert torch.equal(v, plain[k][0]) and torch.equal(a, plain[k][1])
    cache = dit.adaln.prepare([s.unique_timesteps for s in steps], schedule_key(steps))
    assert all(torch.equal(x, y) for x, y in zip(cache.t_embs, embs))
