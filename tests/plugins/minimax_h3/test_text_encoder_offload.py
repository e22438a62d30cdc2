"""MiniMax-H3 with ``--model-option text_encoder_offload=cpu``: the Qwen3-VL conditioner is loaded into host
memory (whole, never TP-split, left out of quantization) and encodes there; under ``--parallel`` only rank 0 holds
it and broadcasts its rows. The frames and the audio equal the resident encoder's: on one process bit for bit (the
same modules on the same device), over two gloo ranks (``ulysses=2``, ``tp=2``) as the resident parallel runs
equal the single process (within one uint8 level, audio 1e-4). On CPU the host and the device are the same memory,
so what these tests check is the code path and the outputs; that a GPU's memory drops is the planner's arithmetic
(tests/core/test_plan.py) and is unmeasured on a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omnicore.engine.api import Engine, make_request

PARAMS = {"num_inference_steps": 2, "height": 64, "width": 64, "duration": 4.0, "extra": {"aspect_ratio": "1:1"}}
HOST = {"text_encoder_offload": "cpu"}


def _engine(path: Path, parallel: str | None = None, options: dict[str, Any] | None = None,
            quantization: str | None = None) -> Engine:
    return Engine(str(path), parallel=parallel, model_options=options, quantization=quantization)


def _run(engine: Engine, prompt: str = "rain on a tin roof", seed: int = 5) -> Any:
    [out] = engine.submit(make_request(prompt, seed=seed, **PARAMS)).result(600)
    return out


@pytest.fixture(scope="module")
def resident(tiny_dir: Path) -> Any:
    with _engine(tiny_dir) as engine:
        return _run(engine)


@pytest.mark.slow  # two tiny-H3 engine loads and runs (~10 s on the shared host)
def test_host_encoder_gives_the_resident_outputs_bit_for_bit(tiny_dir: Path, resident: Any) -> None:
    with _engine(tiny_dir, options=HOST) as engine:
        pipe = engine.pipeline
        assert pipe.text_encoder_on_host and pipe.text_encoder is not None
        assert {p.device.type for p in pipe.text_encoder.model.parameters()} == {"cpu"}
        out = _run(engine)
    assert np.array_equal(out.frames, resident.frames)
    assert np.array_equal(out.audio, resident.audio)


@pytest.mark.slow
def test_quantization_leaves_the_host_encoder_as_loaded(tiny_dir: Path) -> None:
    from omni_minimax_h3.presets import quantization_targets

    with _engine(tiny_dir, options=HOST, quantization="int8") as engine:
        assert "text_encoder" not in quantization_targets(engine.pipeline)
        weights = {p.dtype for p in engine.pipeline.text_encoder.model.language_model.layers[0].parameters()}
        assert weights == {engine.pipeline.dtype}  # not int8: the host copy stays as loaded
        assert _run(engine).frames.shape[0] > 0


def _assert_close(got: Any, want: Any) -> None:
    assert got.frames.shape == want.frames.shape and got.audio.shape == want.audio.shape
    assert np.abs(got.frames.astype(int) - want.frames.astype(int)).max() <= 1
    np.testing.assert_allclose(got.audio, want.audio, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # spawns a second rank (gloo)
@pytest.mark.parametrize("parallel", ["ulysses=2", "tp=2"])
def test_two_ranks_share_rank0s_host_encoding(tiny_dir: Path, resident: Any, parallel: str) -> None:
    from torch.distributed.tensor import DTensor

    with _engine(tiny_dir, parallel, options=HOST) as engine:
        encoder = engine.pipeline.text_encoder
        assert encoder is not None and encoder.tensor_parallel is None  # whole on rank 0, even under tp
        assert not any(isinstance(p, DTensor) for p in encoder.model.parameters())
        out = _run(engine)
        stats = engine.group.ctx.stats.snapshot()
    assert stats["calls"]["encode_broadcast"] == 2  # rows and tags, once each for the one request
    _assert_close(out, resident)
