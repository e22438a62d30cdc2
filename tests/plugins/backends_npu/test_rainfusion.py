"""RainFusion plans for any latent grid (the worked examples), the validated configuration,
dense delegation (warm-up, exempt layers, no grid, short video) and the rf_v2 call through the op seam."""

from __future__ import annotations

import attrs
import pytest
import torch
from _npu_helpers import needs_npu
from omni_backends_npu import seam
from omni_backends_npu.attention import npu_rainfusion_attention
from omni_backends_npu.cpu_reference import CpuReferenceOps
from omni_backends_npu.rainfusion import (
    BLOCK_ROWS,
    RainFusion,
    RainFusionConfig,
    build_plan,
    keep_count,
    parse_layer_selector,
)
from omnicore.attention.metadata import AttentionMetadata
from omnicore.attention.reference import sdpa_attention
from omnicore.errors import ConfigError

PREFIXES = (1, 127, 128, 710, 900)


@pytest.mark.parametrize("prefix", PREFIXES)
def test_misaligned_grid_yields_a_plan(prefix):
    """1344x768: grid (62, 24, 42) — 62496 video rows, not a multiple of 128 — still gets a plan."""
    plan = build_plan(prefix, (62, 24, 42))
    assert plan is not None and BLOCK_ROWS == plan.block_size == 128
    assert plan.prefix_len == prefix and plan.used_len == prefix + 62496
    assert list(plan.latent_shape) == [62, 24, 42]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_aligned_grid_plan(prefix):
    plan = build_plan(prefix, (62, 24, 40))
    assert plan.prefix_len == prefix and plan.used_len == prefix + 59520 and list(plan.latent_shape) == [62, 24, 40]
    assert plan.promoted_rows == 0 and plan.sparse_blocks == 465


def test_worked_example_1344x768():
    plan = build_plan(710, (62, 24, 42))
    assert plan.video_rows == 62496 and plan.residue == 32
    assert plan.suffix_rows == 2928  # the two latent columns beyond 8-wide tiles
    assert plan.promoted_rows == 2976
    assert plan.sparse_rows == 59520 == 465 * 128 and plan.sparse_blocks == 465
    assert plan.realised_sparsity < plan.sparsity  # promoted rows stay visible
    assert "prefix 710 rows" in plan.describe() and "[62, 24, 42]" in plan.describe()


@pytest.mark.parametrize("grid", [(1, 1, 1), (1, 3, 5), (2, 7, 9), (5, 16, 10), (13, 30, 52), (31, 45, 80)])
def test_any_grid_yields_a_consistent_plan(grid):
    plan = build_plan(7, grid, sparsity=0.5)
    assert plan.used_len == 7 + grid[0] * grid[1] * grid[2]
    assert plan.sparse_rows % 128 == 0 and 0 <= plan.promoted_rows <= plan.video_rows
    assert plan.sparse_rows + plan.promoted_rows == plan.video_rows


@pytest.mark.parametrize("grid", [None, (62, 24), (0, 24, 42), (62, 24.0, 42), (62, -1, 42)])
def test_bad_grids_are_refused(grid):
    with pytest.raises(ValueError, match="latent grid"):
        build_plan(10, grid)


# ---------------------------------------------------------------------------------------------- configuration
@pytest.mark.parametrize(("text", "layers"), [
    ("0-3,38", {0, 1, 2, 3, 38}), ("", set()), (None, set()), (" 5 ", {5}), ("2-2, 7-8", {2, 7, 8}), ([1, 4], {1, 4}),
])
def test_skip_layer_selector(text, layers):
    assert parse_layer_selector(text) == frozenset(layers)


@pytest.mark.parametrize("text", ["3-1", "-1", "a", "1,,2", "1-", "0-3;38", "1.5", [-1], ["1"]])
def test_bad_skip_layer_selectors_name_the_field(text):
    with pytest.raises(ConfigError) as err:
        RainFusionConfig(skip_layers=text)
    assert err.value.name == "rainfusion.skip_layers"


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"sparsity": -0.1}, "rainfusion.sparsity"), ({"sparsity": 1.5}, "rainfusion.sparsity"),
    ({"sparsity": "0.8"}, "rainfusion.sparsity"), ({"sparsity": True}, "rainfusion.sparsity"),
    ({"start_step": -1}, "rainfusion.start_step"), ({"start_step": 1.0}, "rainfusion.start_step"),
])
def test_config_is_validated(kwargs, field):
    with pytest.raises(ConfigError) as err:
        RainFusionConfig(**kwargs)
    assert err.value.name == field


def test_config_bounds_and_mapping():
    assert RainFusionConfig(sparsity=0.0).sparsity == 0.0 and RainFusionConfig(sparsity=1).sparsity == 1
    cfg = RainFusionConfig.from_mapping({"sparsity": 0.6, "start_step": 3, "skip_layers": "0-1"})
    assert (cfg.sparsity, cfg.start_step, cfg.skip_layers) == (0.6, 3, frozenset({0, 1}))
    with pytest.raises(ConfigError, match="rainfusion.sparsty"):
        RainFusionConfig.from_mapping({"sparsty": 0.5})


# ---------------------------------------------------------------------------------------------- delegation
def _metadata(prefix, grid, pad=0, **kwargs):
    real = prefix + grid[0] * grid[1] * grid[2]
    if pad:
        return AttentionMetadata(cu_seqlens_q=(0, real, real + pad), max_seqlen_q=real, max_seqlen_k=real,
                                 valid_kv_length=real, latent_grid=grid, **kwargs)
    return AttentionMetadata(cu_seqlens_q=(0, real), latent_grid=grid, **kwargs)


def test_warm_up_steps_and_exempt_layers_stay_dense():
    rf = RainFusion(RainFusionConfig(sparsity=0.5, start_step=2, skip_layers="0-1,5"))
    md = _metadata(20, (2, 16, 16), pad=12)
    assert rf.plan(md, step=0, layer=3) is None and rf.plan(md, step=1, layer=3) is None
    assert rf.plan(md, step=2, layer=0) is None and rf.plan(md, step=4, layer=5) is None
    plan = rf.plan(md, step=2, layer=3)
    assert plan is not None and plan.prefix_len == 20 and plan.used_len == 532 and plan.sparsity == 0.5
    assert rf.metadata_for(md, step=2, layer=3).sparse_plan == plan
    assert rf.metadata_for(md, step=0, layer=3) is md
    assert rf.metadata_for(attrs.evolve(md, sparse_plan=plan), step=0, layer=3).sparse_plan is None
    assert "exempt layers 0,1,5" in rf.describe() and "start step 2" in rf.describe()


def test_no_grid_multi_documents_short_video_or_causal_stay_dense():
    rf = RainFusion(RainFusionConfig(sparsity=0.5))
    assert rf.plan(attrs.evolve(_metadata(20, (2, 16, 16)), latent_grid=None), step=0, layer=0) is None
    two_docs = AttentionMetadata(cu_seqlens_q=(0, 532, 1064), latent_grid=(2, 16, 16))  # batch CFG: not one doc
    assert rf.plan(two_docs, step=0, layer=0) is None
    assert rf.plan(_metadata(20, (1, 8, 8)), step=0, layer=0) is None  # 64 video rows: no block selection
    assert rf.plan(AttentionMetadata(cu_seqlens_q=(0, 100), latent_grid=(2, 16, 16)), step=0, layer=0) is None
    assert rf.plan(_metadata(20, (2, 16, 16), causal=True), step=0, layer=0) is None
    assert rf.plan(_metadata(20, (2, 16, 16)), step=0, layer=0).used_len == 532


def test_keep_count():
    assert [keep_count(10, s) for s in (0.0, 0.5, 0.8, 0.95, 1.0)] == [10, 5, 2, 1, 1]
    assert keep_count(0, 0.5) == 0


# ---------------------------------------------------------------------------------------------- execution
@pytest.fixture
def ops():
    with seam.use_ops(CpuReferenceOps()) as installed:
        yield installed


def _qkv(rows, heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, heads, dim, generator=g) for _ in range(3))


def test_sparse_call_covers_used_rows_only_and_dense_at_zero_sparsity(ops, caplog):
    md = _metadata(20, (2, 16, 16), pad=12)  # 532 real rows + 12 padding rows
    plan = RainFusion(RainFusionConfig(sparsity=0.0)).plan(md, step=0, layer=0)
    q, k, v = _qkv(544, seed=1)
    from omni_backends_npu import attention

    attention._ANNOUNCED.clear()
    with caplog.at_level("INFO", logger="omni_backends_npu"):
        out = npu_rainfusion_attention(q, k, v, metadata=attrs.evolve(md, sparse_plan=plan), scale=0.25)
    assert "grid [2, 16, 16], prefix 20 rows, video 512 rows" in caplog.text
    (call,) = ops.calls
    assert call.op == "sparse_attention" and call.kwargs["plan"] is plan and call.kwargs["scale"] == 0.25
    assert tuple(call.query.shape) == (1, 532, 2, 16) and call.key.data_ptr() == k.data_ptr()  # nothing padded
    torch.testing.assert_close(out[:532], sdpa_attention(q, k, v, metadata=md, scale=0.25)[:532])
    assert torch.equal(out[532:], torch.zeros(12, 2, 16))


def test_sparse_selection_drops_key_blocks_but_keeps_the_prefix(ops):
    md = _metadata(20, (4, 16, 16))  # 1024 video rows = 8 blocks
    plan = RainFusion(RainFusionConfig(sparsity=0.75)).plan(md, step=0, layer=0)
    q, k, v = _qkv(md.total_q, seed=2)
    out = npu_rainfusion_attention(q, k, v, metadata=attrs.evolve(md, sparse_plan=plan))
    dense = sdpa_attention(q, k, v, metadata=md)
    assert not torch.allclose(out[20:], dense[20:], atol=1e-4)  # blocks were dropped
    torch.testing.assert_close(out[:20], dense[:20])  # prefix queries see everything
    k2 = k.clone()
    k2[:20] += 5.0  # every video query block attends to the prefix keys
    assert not torch.allclose(npu_rainfusion_attention(q, k2, v, metadata=attrs.evolve(md, sparse_plan=plan))[20:],
                              out[20:])


def test_without_a_plan_the_backend_is_npu_varlen(ops):
    md = _metadata(20, (1, 8, 8), pad=4)
    q, k, v = _qkv(md.total_q, seed=3)
    npu_rainfusion_attention(q, k, v, metadata=md)
    short = build_plan(20, (1, 8, 8))  # too short for block selection: dense even with a plan attached
    npu_rainfusion_attention(q, k, v, metadata=attrs.evolve(md, sparse_plan=short))
    assert [c.op for c in ops.calls] == ["varlen_attention", "varlen_attention"]


def test_a_plan_that_does_not_cover_the_real_rows_is_an_error(ops):
    md = _metadata(20, (2, 16, 16), pad=12)
    wrong = build_plan(30, (2, 16, 16))
    q, k, v = _qkv(544, seed=4)
    with pytest.raises(ValueError, match="covers 542 rows"):
        npu_rainfusion_attention(q, k, v, metadata=attrs.evolve(md, sparse_plan=wrong))


@needs_npu
def test_rf_v2_at_zero_sparsity_matches_dense_on_an_npu():  # pragma: no cover - Ascend machines only
    """Accuracy: prefix 384, grid (4, 16, 10) = 640 rows, 1024 total, 4 heads, head dim 128, bf16: mean
    relative error against dense SDPA below 2e-3."""
    md = _metadata(384, (4, 16, 10))
    plan = RainFusion(RainFusionConfig(sparsity=0.0)).plan(md, step=0, layer=0)
    assert plan is not None and plan.used_len == 1024
    q, k, v = (t.to("npu", torch.bfloat16) for t in _qkv(1024, heads=4, dim=128, seed=5))
    out = npu_rainfusion_attention(q, k, v, metadata=attrs.evolve(md, sparse_plan=plan)).float().cpu()
    want = sdpa_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), metadata=md)
    assert float((out - want).abs().mean() / want.abs().mean()) < 2e-3
