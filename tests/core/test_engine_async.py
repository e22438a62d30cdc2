"""AsyncEngine: preprocess once per entry point, results and events delivered to the loop, no work on it."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from _engine_helpers import PreprocessCounter, StepGate
from omnicore.config import Settings
from omnicore.engine.api import AsyncEngine, Engine
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.errors import Cancelled


@pytest.fixture
def engine_and_counter(toy_host, tmp_path):
    counter = PreprocessCounter()
    toy_host.add_plugin(counter, "counter")
    engine = Engine("tiny:toy", host=toy_host, settings=Settings(cache_dir=str(tmp_path)))
    yield engine, counter
    assert engine.close(cancel_running=True, timeout=30)


def req(seed: int = 3, **extra) -> GenerationRequest:
    return GenerationRequest("an async lamp", SamplingParams(seed=seed, num_inference_steps=4), extra=extra or None)


def test_async_submit_and_result_preprocess_once_off_the_loop(engine_and_counter):
    engine, counter = engine_and_counter

    async def main():
        aengine = AsyncEngine(engine)
        job = await aengine.submit(req())
        outs = await aengine.result(job)
        return job, outs, threading.get_ident()

    job, outs, loop_thread = asyncio.run(main())
    assert counter.calls == {job.id: 1}
    assert counter.threads[job.id] != loop_thread  # preprocess ran in the executor, not on the loop
    assert job.request is counter.returned[job.id]
    [ref] = engine.generate("an async lamp", seed=3, num_inference_steps=4)
    assert np.array_equal(outs[0].frames, ref.frames)


def test_async_events_and_stream_preprocess_once(engine_and_counter):
    engine, counter = engine_and_counter

    async def main():
        aengine = AsyncEngine(engine)
        job = await aengine.submit(req(seed=5))
        via_events = [e async for e in aengine.events(job)]
        via_stream = [e async for e in aengine.stream(req(seed=6))]
        return job, via_events, via_stream

    job, via_events, via_stream = asyncio.run(main())
    assert len(counter.calls) == 2 and set(counter.calls.values()) == {1}
    for events in (via_events, via_stream):
        assert events[-1].phase == "done"
        progress = [e.progress for e in events]
        assert progress == sorted(progress)
    assert [e.step for e in via_stream if e.phase == "denoise"] == [1, 2, 3, 4]
    assert via_stream[0].job_id != job.id


def test_events_of_a_finished_job_end_with_its_terminal_event(engine_and_counter):
    engine, _ = engine_and_counter
    job = engine.submit(req())
    job.result(30)

    async def main():
        return [e async for e in AsyncEngine(engine).events(job)]

    events = asyncio.run(main())
    assert [e.phase for e in events] == ["done"]


def test_async_cancel_surfaces_cancelled(engine_and_counter, toy_host):
    engine, _ = engine_and_counter
    gate = StepGate(at_step=1)
    toy_host.add_plugin(gate, "gate")

    async def main():
        aengine = AsyncEngine(engine)
        job = await aengine.submit(req(tag="gate"))
        await asyncio.get_running_loop().run_in_executor(None, gate.reached.wait, 30)
        job.cancel()
        gate.release.set()
        with pytest.raises(Cancelled):
            await aengine.result(job)
        return job

    assert asyncio.run(main()).status == "cancelled"


def test_async_generate(engine_and_counter):
    engine, counter = engine_and_counter
    outs = asyncio.run(AsyncEngine(engine).generate("an async lamp", seed=9, num_outputs=2))
    assert [o.seed for o in outs] == [9, 10] and len(counter.calls) == 1
