"""Engine behaviour on the test-only toy model: admission, batching, cancellation, progress, seeds, failures."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _engine_helpers import PreprocessCounter, StepGate
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.engine.request import GenerationRequest, SamplingParams
from omnicore.errors import Cancelled, EngineClosed, InvalidRequest, QueueFull
from omnicore.hookspecs import hookimpl


@pytest.fixture
def make_engine(toy_host, tmp_path):
    engines: list[Engine] = []

    def make(model: str = "tiny:toy", **settings) -> Engine:
        engine = Engine(model, host=toy_host, settings=Settings(cache_dir=str(tmp_path / "cache"), **settings))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        assert engine.close(cancel_running=True, timeout=30)


def req(prompt: str = "a red cube", *, tag: str | None = None, quality: str = "standard",
        **params) -> GenerationRequest:
    params.setdefault("seed", 7)
    return GenerationRequest(prompt, SamplingParams(**params), quality=quality,
                             extra={"tag": tag} if tag else None)


def _until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


# ---------------------------------------------------------------------------------------------- basics


def test_generate_image_and_video(make_engine):
    engine = make_engine()
    [img] = engine.generate("a cat", seed=1, height=40, width=24)
    assert img.kind == "image" and img.frames.shape == (1, 40, 24, 3) and img.frames.dtype == np.uint8
    assert img.fps is None and img.seed == 1
    [vid] = engine.generate("a cat", seed=1, num_frames=5, fps=12)
    assert vid.kind == "video" and vid.frames.shape == (5, 32, 32, 3) and vid.fps == 12.0
    for key in ("preprocess_s", "queue_s", "encode_s", "denoise_s", "decode_s", "postprocess_s", "total_s"):
        assert vid.metrics[key] >= 0.0, key
    assert vid.metrics["peak_memory_bytes"] > 0  # the batch's peak RSS window (Linux), see test_peak_memory
    assert vid.metrics["steps"] == engine.spec.defaults.num_inference_steps
    assert engine.spec.provider == "toy"


def test_generate_rejects_unknown_keyword_naming_it(make_engine):
    engine = make_engine()
    with pytest.raises(InvalidRequest) as info:
        engine.generate("a cat", stepz=3)
    assert info.value.field == "stepz"
    with pytest.raises(InvalidRequest) as info:
        engine.generate("a cat", extra={"colour": "red"})
    assert info.value.field == "extra.colour"
    with pytest.raises(InvalidRequest) as info:
        engine.generate("a cat", height=36)
    assert info.value.field == "params.height" and "multiple of 8" in info.value.rule


# ---------------------------------------------------------------------------------------------- preprocess once


def test_submit_and_generate_preprocess_once_in_callers_thread(make_engine, toy_host):
    counter = PreprocessCounter()
    toy_host.add_plugin(counter, "counter")
    engine = make_engine()
    job = engine.submit(req())
    job.result(30)
    rid = job.id
    assert counter.calls == {rid: 1}
    assert engine.pipeline.preprocess_calls == {rid: 1}
    assert counter.threads[rid] == threading.get_ident()
    assert job.request is counter.returned[rid]  # what preprocess returned is what was queued and run
    engine.generate("another", seed=3)
    assert sorted(counter.calls.values()) == [1, 1] and len(engine.pipeline.preprocess_calls) == 2
    assert all(t == threading.get_ident() for t in engine.pipeline.preprocess_threads.values())


class PromptRewriter:
    """A preprocess plugin whose returned request differs from the submitted one."""

    @hookimpl(tryfirst=True)
    def omnicore_preprocess(self, request, pipeline):
        return pipeline.preprocess(request.evolve(prompt="rewritten prompt"))


def test_the_request_preprocess_returns_is_what_runs(make_engine, toy_host):
    engine = make_engine()
    [direct] = engine.submit(req("rewritten prompt")).result(30)
    toy_host.add_plugin(PromptRewriter(), "rewriter")
    job = engine.submit(req("original prompt"))
    [out] = job.result(30)
    assert job.request.prompt == "rewritten prompt"
    assert np.array_equal(out.frames, direct.frames)


def test_preprocess_failure_is_raised_to_the_caller_and_nothing_is_queued(make_engine):
    engine = make_engine()
    events = []
    with pytest.raises(Exception, match="asked to fail at preprocess"):
        engine.submit(GenerationRequest("x", SamplingParams(seed=1), extra={"fail_at": "preprocess"}),
                      on_event=events.append)
    assert engine.stats()["queued"] == 0
    assert [e.phase for e in events] == ["preprocess", "failed"]


# ---------------------------------------------------------------------------------------------- progress


def test_progress_events_are_ordered_and_monotone(make_engine):
    engine = make_engine()
    events = []
    job = engine.submit(req(num_inference_steps=5), on_event=events.append)
    job.result(30)
    phases = [e.phase for e in events]
    assert phases[:2] == ["preprocess", "queued"]
    assert phases[-3:] == ["decode", "postprocess", "done"]
    assert [e.step for e in events if e.phase == "denoise"] == [1, 2, 3, 4, 5]
    assert all(e.total_steps == 5 for e in events if e.phase == "denoise")
    progress = [e.progress for e in events]
    assert progress == sorted(progress) and progress[-1] == 1.0 and progress[0] == 0.0
    assert all(e.eta_s is None for e in events if e.phase in ("preprocess", "queued", "encode"))
    assert all(e.eta_s is not None and e.eta_s >= 0 for e in events if e.phase == "denoise")
    elapsed = [e.elapsed_s for e in events]
    assert elapsed == sorted(elapsed)
    assert all(e.job_id == job.id for e in events)
    assert job.progress is events[-1]
    assert job.created_at <= job.started_at <= job.finished_at


def test_listener_errors_do_not_break_the_job(make_engine):
    engine = make_engine()

    def bad(event):
        raise RuntimeError("listener bug")

    assert len(engine.submit(req(), on_event=bad).result(30)) == 1


# ---------------------------------------------------------------------------------------------- seeds, determinism


def test_same_seed_gives_identical_bytes_and_other_seeds_differ(make_engine):
    engine = make_engine()
    a = engine.generate("a blue sphere", seed=11, num_frames=3)
    b = engine.generate("a blue sphere", seed=11, num_frames=3)
    c = engine.generate("a blue sphere", seed=12, num_frames=3)
    assert a[0].frames.tobytes() == b[0].frames.tobytes()
    assert a[0].frames.tobytes() != c[0].frames.tobytes()
    img1 = engine.generate("a blue sphere", seed=11)
    img2 = engine.generate("a blue sphere", seed=11)
    assert img1[0].to_bytes("png") == img2[0].to_bytes("png")


def _solo(pipeline, request):
    """An independent reference: drive the pipeline by hand, without the engine."""
    state = pipeline.encode([pipeline.preprocess(request)])
    for step in range(state.num_steps):
        state = pipeline.denoise_step(state, step)
    return pipeline.decode(state)


def test_outputs_use_seed_plus_index(make_engine):
    engine = make_engine()
    outs = engine.generate("three lamps", seed=40, num_outputs=3)
    assert [o.seed for o in outs] == [40, 41, 42] and [o.index for o in outs] == [0, 1, 2]
    for i, out in enumerate(outs):
        [ref] = _solo(engine.pipeline, req("three lamps", seed=40 + i))
        assert np.abs(out.frames.astype(int) - ref.frames.astype(int)).max() <= 1
    assert not np.array_equal(outs[0].frames, outs[1].frames)


def test_unset_seed_is_random_and_recorded(make_engine):
    engine = make_engine()
    [a] = engine.generate("anything")
    [b] = engine.generate("anything")
    assert a.seed is not None and b.seed is not None and a.seed != b.seed
    [again] = engine.generate("anything", seed=a.seed)
    assert np.array_equal(again.frames, a.frames)


# ---------------------------------------------------------------------------------------------- batching


def _batched(engine, requests):
    """Queue all ``requests`` while a gated job holds the worker, then let it form batches from them."""
    gate = StepGate(at_step=0, tag="hold")
    engine.host.add_plugin(gate, f"hold-{id(gate)}")
    holder = engine.submit(req("holder", tag="hold", num_inference_steps=1))
    assert gate.reached.wait(30)
    jobs = [engine.submit(r) for r in requests]
    gate.release.set()
    holder.result(30)
    return [j.result(30) for j in jobs]


def test_compatible_requests_are_batched(make_engine):
    engine = make_engine(max_num_seqs=4, request_batch_max_wait_ms=2000)
    results = _batched(engine, [req(f"p{i}", seed=i) for i in range(3)])
    assert [r[0].metrics["batch_requests"] for r in results] == [3, 3, 3]
    assert engine.stats()["batches_executed"] == 2  # the holder's, then one for all three
    for i, [out] in enumerate(results):  # batching does not change what each request gets (up to rounding)
        [ref] = _solo(engine.pipeline, req(f"p{i}", seed=i))
        assert np.abs(out.frames.astype(int) - ref.frames.astype(int)).max() <= 1


def test_mixed_quality_is_never_batched(make_engine):
    engine = make_engine(max_num_seqs=4, request_batch_max_wait_ms=2000)
    engine.pipeline.batch_key = lambda request: "one key for all"  # even a model that forgets quality
    results = _batched(engine, [req(quality="draft"), req(quality="high"), req(quality="draft")])
    sizes = [r[0].metrics["batch_requests"] for r in results]
    assert sizes == [2, 1, 2]


def test_different_batch_keys_are_never_batched(make_engine):
    engine = make_engine(max_num_seqs=4, request_batch_max_wait_ms=2000)
    results = _batched(engine, [req(tag="a"), req(tag="b"), req(height=48), req(tag="a")])
    assert [r[0].metrics["batch_requests"] for r in results] == [2, 1, 1, 2]


def test_batch_limit_counts_outputs(make_engine):
    engine = make_engine(max_num_seqs=4, request_batch_max_wait_ms=2000)
    results = _batched(engine, [req(num_outputs=3), req(num_outputs=2), req(num_outputs=1)])
    assert [r[0].metrics["batch_outputs"] for r in results] == [4, 2, 4]


def test_model_without_batching_runs_one_request_at_a_time(tmp_path):
    import attrs
    from toy import TOY_SPEC, ToyPlugin, toy_host

    spec = attrs.evolve(TOY_SPEC, capabilities=attrs.evolve(TOY_SPEC.capabilities, supports_batching=False))
    settings = Settings(cache_dir=str(tmp_path), max_num_seqs=4, request_batch_max_wait_ms=2000)
    with Engine("tiny:toy", host=toy_host(settings, plugin=ToyPlugin(spec)), settings=settings) as engine:
        results = _batched(engine, [req(seed=i) for i in range(3)])
    assert [r[0].metrics["batch_requests"] for r in results] == [1, 1, 1]


def test_one_request_with_long_budget_leaves_after_the_stable_window(make_engine):
    engine = make_engine(max_num_seqs=8, request_batch_max_wait_ms=1000)
    [out] = engine.submit(req()).result(30)
    assert 0.04 <= out.metrics["queue_s"] < 0.5


# ---------------------------------------------------------------------------------------------- cancellation


def test_cancel_mid_denoise_stops_within_one_step_and_frees_the_slot(make_engine, toy_host):
    gate = StepGate(at_step=3)
    toy_host.add_plugin(gate, "gate")
    engine = make_engine(max_num_seqs=1)
    events = []
    job = engine.submit(req(tag="gate", num_inference_steps=20), on_event=events.append)
    nxt = engine.submit(req(num_inference_steps=2))
    assert gate.reached.wait(30)
    steps_before = engine.stats()["steps_executed"]
    assert steps_before == 3 and job.status == "running" and nxt.status == "queued"
    assert job.cancel()
    gate.release.set()
    assert job.wait(30)
    assert job.status == "cancelled" and job.outputs == []
    with pytest.raises(Cancelled):
        job.result(0)
    assert not job.cancel()  # already finished
    assert events[-1].phase == "cancelled" and events[-1].step == 4
    nxt.result(30)
    assert engine.stats()["steps_executed"] - steps_before <= 1 + 2  # <= one more step of the job, then nxt's 2
    assert engine.stats()["jobs_cancelled"] == 1


def test_cancel_one_request_of_a_batch_keeps_the_rest(make_engine, toy_host):
    gate = StepGate(at_step=2)
    toy_host.add_plugin(gate, "gate")
    hold = StepGate(at_step=0, tag="hold")
    toy_host.add_plugin(hold, "hold")
    engine = make_engine(max_num_seqs=2, request_batch_max_wait_ms=2000)
    holder = engine.submit(req("holder", tag="hold", num_inference_steps=1))
    assert hold.reached.wait(30)  # the worker is busy: a and b queue up together
    a = engine.submit(req("first", tag="gate", seed=1, num_inference_steps=6))
    b = engine.submit(req("second", tag="gate", seed=2, num_inference_steps=6))
    hold.release.set()
    holder.result(30)
    assert gate.reached.wait(30)
    assert engine.stats()["last_batch_size"] == 2 and a.status == b.status == "running"
    a.cancel()
    gate.release.set()
    [out] = b.result(30)
    assert a.status == "cancelled"
    assert out.metrics["batch_requests"] == 1  # the batch was shrunk
    [ref] = _solo(engine.pipeline, req("second", tag="gate", seed=2, num_inference_steps=6))
    assert np.abs(out.frames.astype(int) - ref.frames.astype(int)).max() <= 1


def test_cancel_queued_job_ends_at_once(make_engine, toy_host):
    gate = StepGate(at_step=0)
    toy_host.add_plugin(gate, "gate")
    engine = make_engine(max_num_seqs=1)
    first = engine.submit(req(tag="gate"))
    assert gate.reached.wait(30)
    queued = engine.submit(req())
    assert queued.cancel() and queued.status == "cancelled"
    assert engine.stats()["queued"] == 0
    gate.release.set()
    first.result(30)


# ---------------------------------------------------------------------------------------------- limits, failures, close


def test_queue_full_rejects_and_drops_nothing(make_engine, toy_host):
    gate = StepGate(at_step=0)
    toy_host.add_plugin(gate, "gate")
    engine = make_engine(max_num_seqs=1, max_queue=2)
    running = engine.submit(req(tag="gate"))
    assert gate.reached.wait(30)
    queued = [engine.submit(req(seed=s)) for s in (1, 2)]
    with pytest.raises(QueueFull) as info:
        engine.submit(req(seed=3))
    assert info.value.limit == 2
    gate.release.set()
    for job in [running, *queued]:
        assert len(job.result(30)) == 1
    assert len(engine.submit(req(seed=3)).result(30)) == 1  # room again


@pytest.mark.parametrize("point", ["encode", "denoise", "decode"])
def test_failing_request_does_not_kill_the_worker(make_engine, point):
    from toy import ToyFailure

    engine = make_engine()
    bad = engine.submit(GenerationRequest("x", SamplingParams(seed=1), extra={"fail_at": point}))
    assert bad.wait(30) and bad.status == "failed" and isinstance(bad.error, ToyFailure)
    with pytest.raises(ToyFailure):
        bad.result()
    assert bad.progress.phase == "failed" and "ToyFailure" in bad.progress.message
    assert len(engine.generate("fine", seed=1)) == 1
    assert engine.stats()["jobs_failed"] == 1


def test_close_finishes_queued_work_then_rejects(make_engine, toy_host):
    gate = StepGate(at_step=0)
    toy_host.add_plugin(gate, "gate")
    engine = make_engine(max_num_seqs=1)
    jobs = [engine.submit(req(tag="gate")), engine.submit(req(seed=2))]
    assert gate.reached.wait(30)
    closer = threading.Thread(target=engine.close)
    closer.start()
    _until(lambda: engine.closed)
    with pytest.raises(EngineClosed):
        engine.submit(req())
    gate.release.set()
    closer.join(30)
    assert [j.status for j in jobs] == ["succeeded", "succeeded"]
    assert engine.close() is True  # idempotent
    with pytest.raises(EngineClosed):
        engine.generate("late")


def test_close_with_cancel_running_cancels_everything(make_engine, toy_host):
    gate = StepGate(at_step=1)
    toy_host.add_plugin(gate, "gate")
    engine = make_engine(max_num_seqs=1)
    running = engine.submit(req(tag="gate", num_inference_steps=10))
    queued = engine.submit(req())
    assert gate.reached.wait(30)
    result = []
    closer = threading.Thread(target=lambda: result.append(engine.close(cancel_running=True, timeout=30)))
    closer.start()
    _until(lambda: running.cancel_requested)
    assert queued.status == "cancelled"  # queued work is cancelled at once
    gate.release.set()
    closer.join(30)
    assert result == [True]
    assert running.status == "cancelled"
    assert engine.stats()["steps_executed"] == 2  # the step in flight when close() came, nothing after


def test_context_manager_closes(toy_host, tmp_path):
    with Engine("tiny:toy", host=toy_host, settings=Settings(cache_dir=str(tmp_path))) as engine:
        engine.generate("x", seed=0)
    assert engine.closed and not engine._worker.is_alive()


class CloseDuringPreprocess:
    """Closes the engine while a request is being preprocessed (after the submit-time closed check)."""

    def __init__(self) -> None:
        self.engine: Engine | None = None

    @hookimpl(wrapper=True)
    def omnicore_preprocess(self, request, pipeline):
        prepared = yield
        assert self.engine is not None and self.engine.close(timeout=30)
        return prepared


def test_a_prepared_request_is_refused_by_an_engine_closed_meanwhile(make_engine, toy_host):
    closer = CloseDuringPreprocess()
    toy_host.add_plugin(closer, "closer")
    engine = make_engine()
    closer.engine = engine
    events = []
    with pytest.raises(EngineClosed):
        engine.submit(req(), on_event=events.append)
    assert list(engine.pipeline.preprocess_calls.values()) == [1]  # it was prepared once, then refused
    assert engine.stats()["queued"] == 0 and [e.phase for e in events] == ["preprocess", "failed"]
