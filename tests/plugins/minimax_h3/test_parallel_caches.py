"""MiniMax-H3 caches over a worker group (gloo, 2 processes): TeaCache (every rank takes rank 0's reuse decision)
with the AdaLN schedule cache (tables built on each rank through the projections it holds: under H3's TP plan a
block's projection holds half its outputs and gathers the rest, so the tables are whole while the "tables >= weights
-> direct" rule and the weight offload see this rank's shard) under ``ulysses=2`` and ``tp=2`` give the frames,
audio and reused steps of the cached single-process engine. Tiny random weights: outputs are noise, compared value
for value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omnicore.engine.api import Engine, make_request

pytestmark = pytest.mark.slow  # each case starts a worker group and loads the model on every rank

PARAMS = {"num_inference_steps": 4, "height": 64, "width": 64, "duration": 4.0, "extra": {"aspect_ratio": "1:1"}}
CACHES = [("teacache", {"rel_l1_thresh": 0.6}), ("adaln_schedule", {"offload_weights": True})]


def _run(path: Path, parallel: str | None) -> tuple[Any, int, Any]:
    with Engine(str(path), parallel=parallel, cache_methods=CACHES) as engine:
        output = engine.submit(make_request("rain on a tin roof", seed=5, **PARAMS)).result(600)[0]
        cache = engine.pipeline.adaln_schedule.cache
        assert cache is not None  # the schedule's tables were built
        return output, output.metrics["cache_reused_steps"], cache


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> tuple[Any, Any, Any]:
    output, reused, cache = _run(tiny_dir, None)
    assert 0 < reused < PARAMS["num_inference_steps"]  # the threshold reuses some steps and computes others
    return output, reused, cache


@pytest.mark.parametrize("parallel", ["ulysses=2", "tp=2"])
def test_cached_parallel_run_equals_the_cached_single_process_run(tiny_dir: Path, reference: Any,
                                                                  parallel: str) -> None:
    expected, expected_reused, expected_cache = reference
    got, reused, cache = _run(tiny_dir, parallel)
    assert cache.table_bytes == expected_cache.table_bytes  # whole tables on every rank
    if parallel == "tp=2":  # rank 0 offloaded only its shard of the blocks' projections (the final layer's whole)
        assert 0 < cache.offloaded_projection_bytes == cache.projection_bytes < expected_cache.projection_bytes
    else:
        assert cache.projection_bytes == expected_cache.projection_bytes
    assert reused == expected_reused
    assert np.abs(got.frames.astype(int) - expected.frames.astype(int)).max() <= 1
    np.testing.assert_allclose(got.audio, expected.audio, rtol=1e-4, atol=1e-5)
