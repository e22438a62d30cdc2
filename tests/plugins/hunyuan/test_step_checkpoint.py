"""HunyuanImage-3's step checkpoints (issue 25): latents plus the prompt K/V the steps reuse; a request resumed
after any step ends as an uninterrupted run's, bit for bit on CPU. Without the saved K/V the first resumed step
recomputes it through the full-sequence path and the image differs in the last bits (checked when this was built)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omnicore.engine.api import Engine, make_request
from omnicore.testing import check_step_checkpoints

pytestmark = pytest.mark.slow


def test_a_request_resumes_to_the_same_bits_after_every_step(micro_dir: Path) -> None:
    with Engine(str(micro_dir)) as engine:
        request = make_request("a paper crane", seed=9, num_inference_steps=3, height=64, width=64)
        assert check_step_checkpoints(engine, request) == [1, 2]
