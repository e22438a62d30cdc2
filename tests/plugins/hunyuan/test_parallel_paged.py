"""HunyuanImage-3's paged prefix pool (``kv_mode=paged_scheduler``) over a worker group (gloo, 2 processes): under
``tp=2`` each rank's pool holds the K/V of its own key/value heads for both CFG rows, under ``cfg=2`` the K/V of its
own CFG row with every head. A first request misses and publishes, a second with the same prompt reuses the
published prefix blocks; both images equal the single-process paged engine's (which equals the dense mode's:
test_kv.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omnicore.engine.api import Engine, make_request

pytestmark = pytest.mark.slow
PARAMS = {"height": 64, "width": 64, "num_inference_steps": 3, "guidance_scale": 4.0}
OPTIONS = {"kv_mode": "paged_scheduler", "kv_block_size": 8, "kv_pool_blocks": 64}
PROMPT = "a lighthouse at dusk"
BLOCK = OPTIONS["kv_block_size"]


def _twice(engine: Engine) -> list[Any]:
    """The same prompt twice, one after the other (the second finds the first's published blocks)."""
    return [engine.submit(make_request(PROMPT, seed=seed, **PARAMS)).result(600)[0] for seed in (7, 8)]


@pytest.fixture(scope="module")
def reference(micro_dir: Path) -> list[Any]:
    with Engine(str(micro_dir), model_options=OPTIONS) as engine:
        outputs = _twice(engine)
        blocks_per_row = int(outputs[1].metrics["kv_pool_hit_tokens"]) // BLOCK
        assert blocks_per_row > 0 and engine.pipeline.pool.stats.published == 2 * blocks_per_row
        return outputs


@pytest.mark.parametrize("parallel", ["tp=2", "cfg=2"])
def test_the_paged_pool_per_rank_gives_the_single_process_images(micro_dir: Path, reference: list[Any],
                                                                  parallel: str) -> None:
    from omni_hunyuan.transformer.config import HunyuanConfig

    config = HunyuanConfig.from_file(micro_dir / "config.json")
    with Engine(str(micro_dir), parallel=parallel, model_options=OPTIONS) as engine:
        outputs = _twice(engine)
        pool = engine.pipeline.pool  # rank 0's
        for got, expected in zip(outputs, reference):
            assert got.frames.shape == expected.frames.shape
            assert np.abs(got.frames.astype(int) - expected.frames.astype(int)).max() <= 1  # fp32 reassociation
        hit = outputs[1].metrics["kv_pool_hit_tokens"]
        assert outputs[0].metrics["kv_pool_hit_tokens"] == 0 and hit == reference[1].metrics["kv_pool_hit_tokens"]
        blocks_per_row = int(hit) // BLOCK
        rows = 2 if parallel == "tp=2" else 1  # a CFG rank keeps its own row's prefix only
        assert pool.stats.published == rows * blocks_per_row and pool.stats.hit_blocks == rows * blocks_per_row
        heads = config.num_key_value_heads // (2 if parallel == "tp=2" else 1)  # a TP rank keeps its heads' K/V
        assert {tuple(b.keys[0].shape[:2]) for b in pool._blocks.values()} == {(BLOCK, heads)}
