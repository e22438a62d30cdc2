"""MiniMax-H3's step checkpoints (issue 25): the packed video and audio rows of a request resumed after any step
end as an uninterrupted run's, bit for bit on CPU (one output and two outputs per request)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omnicore.engine.api import Engine, make_request
from omnicore.testing import check_step_checkpoints

pytestmark = pytest.mark.slow
# a directory load takes the real model's defaults: a tiny canvas and 4 s (107 frames) instead
TINY = {"height": 64, "width": 64, "duration": 4.0, "extra": {"aspect_ratio": "1:1"}}


def test_a_request_resumes_to_the_same_bits_after_every_step(tiny_dir: Path) -> None:
    with Engine(str(tiny_dir)) as engine:
        one = make_request("waves at dusk", seed=3, num_inference_steps=4, **TINY)
        assert check_step_checkpoints(engine, one) == [1, 2, 3]
        two = make_request("waves at dawn", seed=4, num_inference_steps=3, num_outputs=2, **TINY)
        assert check_step_checkpoints(engine, two) == [1, 2]
