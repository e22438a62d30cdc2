"""LingBot with ``--model-option text_encoder_offload=cpu``: the Qwen3-VL encoder is loaded into host memory and
encodes there, it leaves model offload's and quantization's modules, and under ``--parallel`` only rank 0 holds it
and broadcasts its rows (the positive and the negative prompt's). Frames equal the resident encoder's: bit for bit on
one process, within one uint8 level over two gloo ranks (``cfg=2``, like the resident parallel runs). On CPU the host
and the device are one memory: these tests check the code path and the outputs, not a GPU's memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omnicore.engine.api import Engine, make_request

SMALL = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 3.0}
HOST = {"text_encoder_offload": "cpu"}


def _frames(engine: Engine) -> np.ndarray:
    [out] = engine.submit(make_request("a red fox", seed=11, **SMALL)).result(600)
    return out.frames


@pytest.fixture(scope="module")
def resident(tiny_dir: Path) -> np.ndarray:
    with Engine(str(tiny_dir)) as engine:
        return _frames(engine)


@pytest.mark.slow  # two tiny-LingBot engine loads and runs
def test_host_encoder_gives_the_resident_frames_bit_for_bit(tiny_dir: Path, resident: np.ndarray) -> None:
    from omni_lingbot.presets import quantization_targets

    with Engine(str(tiny_dir), model_options=HOST) as engine:
        pipe = engine.pipeline
        assert pipe.text_encoder_on_host and {p.device.type for p in pipe.text_encoder.model.parameters()} == {"cpu"}
        assert "text_encoder" not in pipe.offload_modules and "text_encoder" not in quantization_targets(pipe)
        assert np.array_equal(_frames(engine), resident)


@pytest.mark.slow  # spawns a second rank (gloo)
def test_cfg_ranks_share_rank0s_host_encoding(tiny_dir: Path, resident: np.ndarray) -> None:
    with Engine(str(tiny_dir), parallel="cfg=2", model_options=HOST) as engine:
        frames = _frames(engine)
        stats = engine.group.ctx.stats.snapshot()
    assert stats["calls"]["encode_broadcast"] == 2  # the caption's rows and the negative prompt's
    assert frames.shape == resident.shape and np.abs(frames.astype(int) - resident.astype(int)).max() <= 1
