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
from omnicore.plugin import hookimpl

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


# ------------------------------------------------------------------ the engine drives the loop
class CancelAt:
    """Cancels ``job`` when a batch of several requests reaches denoise step ``step``."""

    def __init__(self, step: int) -> None:
        self.step, self.job = step, None

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline: Any, state: Any, step: int) -> Any:
        if step == self.step and self.job is not None and len(state.requests) > 1:
            self.job.cancel()
        return (yield)


def _batching_engine(model: Any, settings: Any) -> Any:
    from _diffusers_helpers import make_engine

    return make_engine(model, settings.evolve(max_num_seqs=4, request_batch_max_wait_ms=2000))


def _cancel_the_middle_row(engine: Any, prompts: list[str], seeds: list[int], steps: int,
                           at: int) -> tuple[list[Any], list[int]]:
    """Three requests batched together, the middle one cancelled at step ``at``: the survivors' outputs and the
    row count of every denoiser forward."""
    from omnicore.engine.api import make_request

    gate = CancelAt(at)
    rows: list[int] = []
    model = engine.pipeline.denoisers[0]
    hook = model.register_forward_pre_hook(lambda m, a, k: rows.append(k["hidden_states"].shape[0]), with_kwargs=True)
    engine.host.pm.register(gate, name="cancel-at")
    try:
        jobs = [engine.submit(make_request(p, seed=s, num_inference_steps=steps, **TINY))
                for p, s in zip(prompts, seeds, strict=True)]
        gate.job = jobs[1]
        outs = [jobs[0].result(120)[0], jobs[2].result(120)[0]]
        jobs[1].wait(120)
        assert jobs[1].status == "cancelled"
    finally:
        engine.host.pm.unregister(gate, name="cancel-at")
        hook.remove()
    return outs, rows


def test_the_engine_owns_the_loop_state(engine: Any) -> None:
    """encode runs the blocks before the loop, each denoise_step one loop iteration, decode the blocks after it:
    no thread, and the latents between steps are the state's (they change once per step)."""
    from omnicore.engine.api import make_request

    pipeline = engine.pipeline
    state = pipeline.encode([pipeline.preprocess(make_request(PROMPT, seed=3, num_inference_steps=3, **TINY))])
    run = state.extras["run"]
    assert "call" not in state.extras and state.num_steps == 3
    seen = [run.block_state.latents.clone()]
    for step in range(3):
        state = pipeline.denoise_step(state, step)
        seen.append(run.block_state.latents.clone())
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:]))
    [out] = pipeline.decode(state)
    [again] = engine.generate(PROMPT, seed=3, num_inference_steps=3, **TINY)
    assert np.array_equal(out.frames, again.frames)


def test_cancelling_one_row_slices_it_out_and_leaves_the_others_exact(settings: Any, reference: Any,
                                                                      engine: Any) -> None:
    """The middle request of a batch of three is cancelled at step 1 of 4: from step 2 on the transformer sees
    two rows (the row left the latents and the embeddings), and the survivors equal their solo runs and the
    stock modular pipeline bit for bit."""
    prompts, seeds = [PROMPT, "a blue cube", "a green tree"], [11, 12, 13]
    with _batching_engine(engine.resolved.path, settings) as batching:
        (first, last), rows = _cancel_the_middle_row(batching, prompts, seeds, steps=4, at=1)
    assert rows == [3, 3, 2, 2], rows
    assert np.array_equal(first.frames, _direct(reference, [prompts[0]], [11], 4))
    assert np.array_equal(last.frames, _direct(reference, [prompts[2]], [13], 4))
    assert np.array_equal(last.frames, engine.generate(prompts[2], seed=13, num_inference_steps=4, **TINY)[0].frames)


# ------------------------------------------------------------------ an order-2 solver (Heun): every step counts
@pytest.fixture(scope="module")
def heun_sd3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SD3's modular blocks (guider CFG with negative embeddings) over the tiny SD3 components with diffusers'
    order-2 FlowMatchHeunDiscreteScheduler, written by save_pretrained."""
    from diffusers import FlowMatchHeunDiscreteScheduler
    from diffusers.modular_pipelines import StableDiffusion3AutoBlocks
    from omni_diffusers.presets import sd3_components

    target = tmp_path_factory.mktemp("heun-sd3")
    pipe = StableDiffusion3AutoBlocks().init_pipeline()
    pipe.update_components(**{**sd3_components(), "scheduler": FlowMatchHeunDiscreteScheduler()})
    pipe.save_pretrained(str(target), overwrite_modular_index=True)
    return target


@pytest.mark.slow
@pytest.mark.parametrize("driven", [True, False], ids=["driven", "threaded"])
def test_an_order_2_solver_reports_and_stops_at_every_step(heun_sd3: Path, settings: Any, driven: bool) -> None:
    """Heun over 3 steps calls scheduler.step 5 times: both the driven loop and the threaded fallback report 5
    steps, once each, and equal the stock modular pipeline (guidance is the guider's own config here). Before,
    the threaded call reported 5 // 2 = 2 and ran the rest inside decode, where nothing could stop it."""
    from _diffusers_helpers import make_engine
    from diffusers.modular_pipelines import ModularPipeline
    from omnicore.engine.api import make_request

    reference = ModularPipeline.from_pretrained(str(heun_sd3))
    reference.load_components()
    expected = reference(prompt=PROMPT, negative_prompt="blurry", generator=_gen(4), num_inference_steps=3,
                         max_sequence_length=32, output="images", output_type="np", **TINY)
    with make_engine(heun_sd3, settings) as eng:
        eng.pipeline.driven = driven
        events: list[Any] = []
        request = make_request(PROMPT, negative_prompt="blurry", seed=4, num_inference_steps=3,
                               extra={"max_sequence_length": 32}, **TINY)
        [out] = eng.submit(request, on_event=events.append).result(120)
    assert [(e.step, e.total_steps) for e in events if e.phase == "denoise"] == [(i, 5) for i in range(1, 6)]
    assert np.array_equal(out.frames[0], (np.asarray(expected)[0] * 255).round().astype("uint8"))


@pytest.mark.slow
def test_cancelling_a_row_between_the_two_halves_of_a_heun_step(heun_sd3: Path, settings: Any) -> None:
    """Cancelled after the first evaluation of a Heun step (the scheduler holds the rows' first-order sample and
    derivative): those per-row tensors are sliced too, so the survivors still equal their solo runs, negative
    embeddings of the guider included."""
    with _batching_engine(heun_sd3, settings) as batching:
        (first, last), rows = _cancel_the_middle_row(batching, ["a", "b", "c"], [1, 2, 3], steps=3, at=2)
        solo = [batching.generate(p, seed=s, num_inference_steps=3, **TINY)[0].frames for p, s in (("a", 1), ("c", 3))]
    # the guider runs the transformer once per branch (conditional, unconditional) in steps 0-2
    assert rows[:6] == [3] * 6 and rows[6:] and set(rows[6:]) == {2}, rows
    assert np.array_equal(first.frames, solo[0]) and np.array_equal(last.frames, solo[1])
