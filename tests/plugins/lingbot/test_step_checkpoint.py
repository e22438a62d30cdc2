"""LingBot's step checkpoints (issue 25): a request resumed from a checkpoint after any step ends with the
uninterrupted run's final latents, bit for bit on CPU — text-to-video, image-to-video (the clean first-frame
prefix) and across the MoE package's refiner stage (its own sampler and text). A request checkpointed inside a
batch and resumed alone is not bit-identical on CPU (a batch's matmuls round differently); that case is measured,
not asserted equal."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omnicore.engine.api import Engine, make_request
from omnicore.testing import check_step_checkpoints
from PIL import Image

pytestmark = pytest.mark.slow
TINY = {"height": 48, "width": 48, "num_frames": 5}  # a directory load takes the real model's defaults


@pytest.fixture(scope="module")
def engine(tiny_dir: Path):
    with Engine(str(tiny_dir)) as eng:
        yield eng


def test_t2v_resumes_to_the_same_bits_after_every_step(engine) -> None:
    request = make_request("a red kite over a beach", seed=5, num_inference_steps=4, **TINY)
    assert check_step_checkpoints(engine, request) == [1, 2, 3]


def test_i2v_with_its_clean_first_frame_resumes_to_the_same_bits(engine) -> None:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (48, 48, 3), dtype=np.uint8))
    request = make_request("the kite flies on", images=[image], modalities=["video"], seed=6,
                           num_inference_steps=3, **TINY)
    assert check_step_checkpoints(engine, request) == [1, 2]


def test_the_refiner_stage_resumes_to_the_same_bits(tiny_moe_dir: Path) -> None:
    extra = {"run_refiner": True, "refiner_height": 64, "refiner_width": 96, "refiner_steps": 2}
    with Engine(str(tiny_moe_dir)) as eng:
        request = make_request("a kite", seed=7, num_inference_steps=2, extra=extra, **TINY)
        # 2 base steps, then the refiner's 4 (its low-noise grid): checkpoints 3..5 are inside the refiner stage,
        # and the one at step 2 is taken as the refiner stage starts (its fresh sampler: no history yet)
        assert check_step_checkpoints(eng, request) == [1, 2, 3, 4, 5]
