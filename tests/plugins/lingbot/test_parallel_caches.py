"""LingBot's first-block cache over a worker group (gloo, 2 processes): the first block's residual change is summed
over the ranks of a guidance branch, so under ``ulysses=2`` (each rank holds half the rows) and ``cfg=2`` (each
rank one branch) every rank skips the same steps, and the video and the reused steps equal the cached
single-process engine's. Tiny random weights: the frames are noise, compared value for value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omnicore.engine.api import Engine, make_request

pytestmark = pytest.mark.slow  # each case starts a worker group and loads the model on every rank

SMALL = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 6, "guidance_scale": 3.0}
CACHES = [("first_block_cache", {"threshold": 1.0})]


def _run(path: Path, parallel: str | None) -> tuple[Any, int]:
    with Engine(str(path), parallel=parallel, cache_methods=CACHES) as engine:
        output = engine.submit(make_request("a red fox", seed=11, **SMALL)).result(600)[0]
        return output, output.metrics["cache_reused_steps"]


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> tuple[Any, int]:
    output, reused = _run(tiny_dir, None)
    assert 0 < reused < SMALL["num_inference_steps"]  # some steps reuse, others compute
    return output, reused


@pytest.mark.parametrize("parallel", ["ulysses=2", "cfg=2"])
def test_cached_parallel_run_equals_the_cached_single_process_run(tiny_dir: Path, reference: Any,
                                                                  parallel: str) -> None:
    expected, expected_reused = reference
    got, reused = _run(tiny_dir, parallel)
    assert reused == expected_reused
    assert np.abs(got.frames.astype(int) - expected.frames.astype(int)).max() <= 1
