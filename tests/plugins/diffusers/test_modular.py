"""A diffusers modular pipeline (``modular_model_index.json``, FLUX's ``FluxAutoBlocks``) through the adapter.

The reference is the same directory loaded by ``ModularPipeline.from_pretrained`` + ``load_components`` and called
directly with ``torch.Generator().manual_seed(seed)``; uint8 pixels are compared exactly (CPU). The components are
the random-weight tiny FLUX ones (the images are noise).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

PROMPT = "a red fox in the snow"
TINY = {"height": 32, "width": 32}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def engine(engines: Any) -> Any:
    return engines["flux-modular"]


@pytest.fixture(scope="module")
def reference(engine: Any) -> Any:
    from diffusers.modular_pipelines import ModularPipeline

    pipe = ModularPipeline.from_pretrained(str(engine.resolved.path))
    pipe.load_components()
    return pipe


def _direct(pipe: Any, prompts: list[str], seeds: list[int], steps: int) -> np.ndarray:
    out = pipe(prompt=prompts, generator=[_gen(s) for s in seeds], num_inference_steps=steps, guidance_scale=3.5,
               max_sequence_length=32, output="images", output_type="np", **TINY)
    return (np.asarray(out) * 255).round().astype("uint8")


def test_the_card_comes_from_the_block_inputs(engine: Any) -> None:
    caps = engine.spec.capabilities
    assert caps.modes == ("t2i", "i2i") and [r.role for r in caps.inputs] == ["reference"]
    assert caps.outputs == ("image",)
    assert "strength" in engine.pipeline.card.extra_keys  # a block input a request may set through extra
    assert "output" not in engine.pipeline.card.extra_keys and "generator" not in engine.pipeline.card.extra_keys


def test_output_equals_the_modular_pipeline_called_directly(engine: Any, reference: Any) -> None:
    [out] = engine.generate(PROMPT, seed=7, num_inference_steps=3, **TINY)
    assert out.kind == "image" and np.array_equal(out.frames, _direct(reference, [PROMPT], [7], 3))
    assert len(out.metrics["step_times_s"]) == 3


def test_a_batch_is_one_call_whose_rows_equal_solo_runs(engine: Any, reference: Any) -> None:
    from omnicore.engine.api import make_request

    pipeline = engine.pipeline
    reqs = [pipeline.preprocess(make_request(p, seed=s, **TINY)) for p, s in ((PROMPT, 11), ("a blue cube", 20))]
    state = pipeline.encode(reqs)
    for step in range(state.num_steps):
        state = pipeline.denoise_step(state, step)
    batched = np.concatenate([o.frames for o in pipeline.decode(state)])
    solo = np.concatenate([engine.generate(r.prompt, seed=r.params.seed, **TINY)[0].frames for r in reqs])
    assert np.array_equal(batched, solo)
    assert np.array_equal(batched, _direct(reference, [PROMPT, "a blue cube"], [11, 20], 2))


def test_progress_once_per_step_and_cancel_within_one_step(engine: Any) -> None:
    from omnicore.engine.api import make_request

    events: list[Any] = []
    engine.submit(make_request(PROMPT, seed=2, num_inference_steps=4, **TINY), on_event=events.append).result(120)
    assert [(e.step, e.total_steps) for e in events if e.phase == "denoise"] == [(i, 4) for i in range(1, 5)]

    pipe = engine.pipeline.pipe
    forwards: list[int] = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, a: forwards.append(1))
    jobs: list[Any] = []
    ready = threading.Event()

    def on_event(event: Any) -> None:
        if event.phase == "denoise" and event.step == 1:
            ready.wait(30)
            jobs[0].cancel()

    try:
        jobs.append(engine.submit(make_request(PROMPT, seed=1, num_inference_steps=6, **TINY), on_event=on_event))
        ready.set()
        jobs[0].wait(120)
    finally:
        hook.remove()
    assert jobs[0].status == "cancelled"
    assert 1 <= len(forwards) <= 2, f"{len(forwards)} transformer forwards after a cancel at step 1 of 6"
    active = engine.pipeline._active  # the dropped batch state aborts its parked call: the thread ends
    deadline = time.monotonic() + 30
    while active is not None and active._thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active is None or not active._thread.is_alive(), "the cancelled call's thread is still parked"
    assert "step" not in vars(pipe.scheduler)  # the stepped call's wrapper is gone
    [out] = engine.generate(PROMPT, seed=1, **TINY)  # the next request is served normally
    assert out.frames.shape == (1, 32, 32, 3)


def test_unknown_extra_is_refused_naming_it(engine: Any) -> None:
    from omnicore.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="not_a_block_input"):
        engine.generate(PROMPT, seed=1, extra={"not_a_block_input": 1}, **TINY)


def test_a_moved_checkpoint_reads_its_own_component_folders(engine: Any, tmp_path: Path, settings: Any) -> None:
    """diffusers writes the absolute save directory into the index; a copy whose original is gone still loads
    (each component folder present in the checkpoint is read from there)."""
    from _diffusers_helpers import make_engine
    from omni_diffusers.presets import build_flux_modular

    original = tmp_path / "original"
    build_flux_modular(original)
    moved = tmp_path / "moved"
    shutil.copytree(original, moved)
    shutil.rmtree(original)
    other = make_engine(moved, settings)
    try:
        [a] = other.generate(PROMPT, seed=5, num_inference_steps=2, **TINY)
        [b] = engine.generate(PROMPT, seed=5, num_inference_steps=2, **TINY)
        assert np.array_equal(a.frames, b.frames)  # the same seeded components
    finally:
        other.close()
