"""KV modes, KV requests, the prepared layout and the paged prefix-KV pool (docs/contracts-status.md C5)."""

from __future__ import annotations

import pytest
import torch
from _hunyuan_helpers import load, request, run, square_image
from omnicore.errors import ConfigError, UnsupportedFeature


# ---------------------------------------------------------------------------------------------- modes
def test_kv_mode_parsing():
    from omni_hunyuan.request_rules import parse_kv_mode

    assert parse_kv_mode(None) == "dense_legacy"
    assert parse_kv_mode("paged_scheduler") == "paged_scheduler"
    with pytest.raises(ConfigError) as info:
        parse_kv_mode("paged")
    assert "expected one of: dense_legacy, paged_worker_local, paged_scheduler" in str(info.value)
    with pytest.raises(UnsupportedFeature, match="reserved but not implemented"):
        parse_kv_mode("paged_worker_local")


def test_unknown_kv_mode_fails_at_load(micro_dir):
    with pytest.raises(ConfigError, match="dense_legacy"):
        load(micro_dir, kv_mode="paged")
    with pytest.raises(UnsupportedFeature):
        load(micro_dir, kv_mode="paged_worker_local")


def test_the_engine_checks_the_declared_option():
    """The mode is a deployment option (declared on the spec, checked at load), not an environment variable."""
    from omni_hunyuan.plugin import MODEL_SPEC
    from omnicore.engine.model_options import resolve_model_options

    assert resolve_model_options(MODEL_SPEC, {})["kv_mode"] == "dense_legacy"
    with pytest.raises(ConfigError, match="paged_scheduler"):
        resolve_model_options(MODEL_SPEC, {"kv_mode": "nope"})


# ---------------------------------------------------------------------------------------------- KV requests
def test_kv_request_lengths_for_one_and_two_rows(paged_pipe):
    for guidance, rows in ((1.0, 1), (4.0, 2)):
        prepared = paged_pipe.preprocess(request(guidance_scale=guidance))
        pl = prepared.plan.prepared_layout
        lay = pl.layout
        assert [kr.sequence_id for kr in pl.kv_requests] == list(range(rows))
        for kr in pl.kv_requests:
            assert (kr.prefix_len, kr.target_len, kr.seq_len) == (lay.gen_timestep, 1 + 16, lay.seq_len)
            assert kr.id == f"{prepared.request_id}/diffusion-kv/{kr.sequence_id}"
            assert len(kr.block_hashes) == lay.prefix_len // 8


def test_kv_request_validation():
    from omni_hunyuan.transformer.layout import DiffusionKVRequest, kv_requests

    with pytest.raises(ValueError, match="must not exceed seq_len"):
        DiffusionKVRequest("r", 0, prefix_len=5, target_len=4, seq_len=8)
    for kwargs, msg in (({"request_id": ""}, "request_id"), ({"sequence_id": -1}, "sequence_id"),
                        ({"prefix_len": -1}, "prefix_len"), ({"target_len": 0}, "target_len")):
        args = {"request_id": "r", "sequence_id": 0, "prefix_len": 1, "target_len": 2, "seq_len": 4, **kwargs}
        with pytest.raises(ValueError, match=msg):
            DiffusionKVRequest(args.pop("request_id"), args.pop("sequence_id"), **args)

    class OneRow:
        rows = 1

    with pytest.raises(ValueError, match="rows=1, cfg_factor=2"):
        kv_requests("r", OneRow(), 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("guidance,with_image", [(1.0, False), (4.0, False), (4.0, True)])
def test_prepared_layout_equals_local_tokenisation(pipe, paged_pipe, guidance, with_image):
    images = (square_image(),) if with_image else ()
    req = request("make it blue" if images else "a red fox", guidance_scale=guidance, images=images)
    prepared = paged_pipe.preprocess(req).plan.prepared_layout.layout
    local = pipe.layout_of(pipe.preprocess(req))  # dense mode tokenises in encode
    import attrs

    assert pipe.preprocess(req).plan.prepared_layout is None
    for field in attrs.fields(type(local)):
        assert getattr(prepared, field.name) == getattr(local, field.name), field.name
    for name in ("gen_image_mask", "cond_vae_image_mask", "cond_vit_image_mask", "gen_timestep_scatter_index",
                 "cond_timestep_scatter_index", "real_pos"):
        assert torch.equal(getattr(prepared, name), getattr(local, name)), name
    assert torch.equal(prepared.positions(), local.positions())
    assert prepared.spans == local.spans and prepared.rows == (2 if guidance > 1 else 1)


# ---------------------------------------------------------------------------------------------- pool
def _fresh(paged_pipe):
    paged_pipe.pool.clear()
    paged_pipe.pool.stats = type(paged_pipe.pool.stats)()
    return paged_pipe.pool


def test_second_identical_prompt_hits_and_targets_are_never_shared(paged_pipe):
    pool = _fresh(paged_pipe)
    state, _ = run(paged_pipe, request(seed=1), decode=False)
    lay = state.extras["items"][0]["layout"]
    blocks_per_row = lay.prefix_len // 8
    assert state.extras["items"][0]["pool_hit_tokens"] == 0
    # both CFG rows published their full prefix blocks; nothing past the prefix (the target) was stored
    assert len(pool) == 2 * blocks_per_row and pool.stats.published == 2 * blocks_per_row
    assert pool.stats.miss_blocks == 2 * blocks_per_row and pool.stats.hit_blocks == 0
    for block in pool._blocks.values():
        assert block.keys[0].shape[0] == 8
    state2, _ = run(paged_pipe, request(seed=2), decode=False)
    assert state2.extras["items"][0]["pool_hit_tokens"] == blocks_per_row * 8
    assert pool.stats.hit_blocks == 2 * blocks_per_row and len(pool) == 2 * blocks_per_row
    # a pool hit computes the same result as the miss did for that seed
    state3, _ = run(load_dense(paged_pipe), request(seed=2), decode=False)
    assert torch.allclose(state2.latents, state3.latents, atol=1e-4)


def load_dense(paged_pipe):
    from omni_hunyuan.pipeline import HunyuanImage3Pipeline

    return HunyuanImage3Pipeline(paged_pipe.model, paged_pipe.tokenizer, paged_pipe.gen_config,
                                 device=paged_pipe.device, dtype=paged_pipe.dtype)


def test_a_different_prompt_misses(paged_pipe):
    _fresh(paged_pipe)
    first, _ = run(paged_pipe, request("a lighthouse at dusk"), decode=False)
    state, _ = run(paged_pipe, request("the windmill at dawn"), decode=False)
    hit = state.extras["items"][0]["pool_hit_tokens"]
    # block 0 holds "<bos>User: " and the prompt's first character, which differs: a miss from the start
    assert hit == 0
    # a prompt sharing the first block's tokens hits exactly that block (sharing is by content, per block)
    shared, _ = run(paged_pipe, request("a windmill at dawn!"), decode=False)
    a, b = first.extras["items"][0]["layout"].tokens[0], shared.extras["items"][0]["layout"].tokens[0]
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared.extras["items"][0]["pool_hit_tokens"] == common // 8 * 8 == 8


def test_a_different_reference_image_or_seed_misses(paged_pipe):
    pool = _fresh(paged_pipe)
    a = square_image(seed=1)
    r1 = paged_pipe.preprocess(request("edit", images=(a,), seed=5)).plan.prepared_layout
    r2 = paged_pipe.preprocess(request("edit", images=(square_image(seed=2),), seed=5)).plan.prepared_layout
    r3 = paged_pipe.preprocess(request("edit", images=(a,), seed=6)).plan.prepared_layout
    r4 = paged_pipe.preprocess(request("edit", images=(a.copy(),), seed=5)).plan.prepared_layout
    h = [r.kv_requests[0].block_hashes for r in (r1, r2, r3, r4)]
    assert h[0] and h[0] != h[1] and h[0] != h[2] and h[0][0] != h[1][0]
    assert h[0] == h[3]  # same pixels, same VAE seed: same identity
    run(paged_pipe, request("edit", images=(a,), seed=5), decode=False)
    state, _ = run(paged_pipe, request("edit", images=(square_image(seed=2),), seed=5), decode=False)
    assert state.extras["items"][0]["pool_hit_tokens"] == 0
    assert len(pool) > 0


def test_lru_budget_evicts_and_counts():
    from omni_hunyuan.kv_pool import PrefixKVPool, block_hashes

    pool = PrefixKVPool(block_size=2, max_blocks=3)
    kv = [torch.arange(8.0).reshape(4, 1, 2)]
    a = block_hashes([1, 2, 3, 4, 5], 5, 2)
    b = block_hashes([9, 9, 9, 9], 4, 2)
    assert len(a) == 2 and block_hashes([1, 2, 3, 4, 5], 5, 2, "img") != a
    assert pool.publish(a, kv, kv) == 2
    assert pool.acquire(a[:1]) == 1  # pin block a0
    assert pool.publish(b, kv, kv) == 2  # needs one eviction: a1 (unpinned, least recent)
    assert pool.stats.evicted == 1 and a[0] in pool and a[1] not in pool
    pool.release(a[:1])
    assert pool.acquire(a) == 1 and pool.stats.miss_blocks == 1
    keys, _ = pool.gather(a[:1])
    assert torch.equal(keys[0], kv[0][:2])


def test_gather_rows_stacks_rows_of_blocks():
    from omni_hunyuan.kv_pool import PrefixKVPool, block_hashes

    pool = PrefixKVPool(block_size=2, max_blocks=8)
    a, b = block_hashes([1, 2, 3, 4], 4, 2), block_hashes([5, 6, 7, 8], 4, 2)
    ka, kb = [torch.arange(8.0).reshape(4, 1, 2)], [-torch.arange(8.0).reshape(4, 1, 2)]
    pool.publish(a, ka, ka)
    pool.publish(b, kb, kb)
    ((k, v),) = pool.gather_rows([a, b])
    assert k.shape == (2, 4, 1, 2) and torch.equal(k[0], ka[0]) and torch.equal(v[1], kb[0])


def test_mode_ownership_of_prepared_layouts(pipe, paged_pipe):
    """Paged mode needs the prepared layout; dense mode refuses one; branch counts must match the CFG rows."""
    import attrs

    dense_req = pipe.preprocess(request())
    paged_req = paged_pipe.preprocess(request())
    with pytest.raises(ValueError, match="did not produce DiffusionKVRequest"):
        paged_pipe.layout_of(dense_req)
    with pytest.raises(ValueError, match="dense_legacy request .* unexpectedly contains"):
        pipe.layout_of(paged_req)
    one_row = paged_pipe.preprocess(request(guidance_scale=1.0)).plan.prepared_layout
    bad = paged_req.evolve(plan=attrs.evolve(paged_req.plan, prepared_layout=one_row))
    with pytest.raises(ValueError, match="prepared branches do not match execution CFG layout"):
        paged_pipe.layout_of(bad)
    with pytest.raises(TypeError, match="PreparedLayout"):
        paged_pipe.layout_of(paged_req.evolve(plan=attrs.evolve(paged_req.plan, prepared_layout={"layout": 1})))
    assert attrs.has(type(paged_req.plan.prepared_layout))
