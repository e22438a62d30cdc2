"""Runs one batch: encode -> denoise steps (through the ``omnicore_denoise`` hook) -> decode -> postprocess.

Cancellation is checked before every step. A cancelled request is dropped from the batch when the
pipeline can shrink its state (``select_requests``); otherwise it is reported cancelled at once and its
rows are computed to the end with the rest and discarded. When every request is cancelled the batch stops.
Any exception fails the batch's unfinished jobs with that error (a ``BaseException`` such as ``SystemExit``
becomes :class:`StepAborted`); the caller (the worker) carries on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

from ..errors import Cancelled
from ..vae_fast_paths import request_fast_paths
from .cancellation import cancel_scope
from .jobs import Job
from .stage_progress import stage_progress_scope
from .step_checkpoint import resume_point, save_due

if TYPE_CHECKING:
    from ..lora.registry import AdapterRef
    from ..lora.runtime import LoRARuntime
    from ..outputs.output import Output
    from ..platforms.base import Platform
    from ..plugin_host.host import PluginHost
    from .protocol import DenoiseState, Pipeline

logger = logging.getLogger("omnicore.engine")


class BatchGroup(Protocol):
    """What the runner tells rank 0's worker group (``omnicore.parallel.group.WorkerGroup``) around a batch."""

    def announce(self, kind: str, *args: object) -> None: ...

    def end_batch(self) -> None: ...

    def fail_batch(self, exc: BaseException) -> None: ...

    def collect(self) -> None: ...

    def encoding(self) -> contextlib.AbstractContextManager[None]: ...

    def explain(self, exc: BaseException) -> BaseException: ...


class StepAborted(RuntimeError):
    """A model or plugin step raised a ``BaseException`` that is not an ``Exception`` (``SystemExit``,
    ``KeyboardInterrupt``, ...). The engine fails the batch with this error rather than letting it unwind the worker."""

    def __init__(self, cause: BaseException) -> None:
        detail = str(cause)
        super().__init__(f"the model's code raised {type(cause).__name__}" + (f" ({detail})" if detail else "")
                         + " during the job; the job was stopped and the worker carries on")
        self.__cause__ = cause


class EngineStats:
    """Counters the engine exposes through ``Engine.stats()`` (updated by the worker only)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.steps_executed = 0
        self.batches_executed = 0
        self.jobs_succeeded = 0
        self.jobs_failed = 0
        self.jobs_cancelled = 0
        self.last_batch_size = 0


class BatchRunner:
    def __init__(self, host: PluginHost, pipeline: Pipeline, platform: Platform, stats: EngineStats,
                 group: BatchGroup | None = None, lora: LoRARuntime | None = None) -> None:
        self.host = host
        self.pipeline = pipeline
        self.platform = platform
        self.stats = stats
        # rank 0's omnicore.parallel.group.WorkerGroup (``--parallel``): told each batch's plan before every
        # pipeline call so the workers run the same calls; None in a single-process engine
        self.group = group
        # the model's omnicore.lora.LoRARuntime (None: the model takes no adapters): told the batch's requests
        # before encode and before every step (so a shrunk batch drops its rows' adapters), cleared after the batch
        self.lora = lora
        self._adapters: dict[str, tuple[AdapterRef, ...]] = {}  # request id -> its adapters' versions (this batch)

    def run(self, jobs: list[Job]) -> None:
        with self.stats.lock:  # counted before any job finishes, so a caller woken by a result sees it
            self.stats.batches_executed += 1
            self.stats.last_batch_size = len(jobs)
        members: list[Job] = []
        try:
            members = [j for j in jobs if not self._cancel_if_requested(j)]
            if members:  # VAE fast-path gates on iff the batch asks for quality "high" (docs/contracts-status.md C7.1)
                with request_fast_paths(self.pipeline, {j.request.quality for j in members}):
                    try:
                        try:
                            self._run(members)
                        finally:
                            self._set_loras([])
                    except BaseException as exc:
                        if self.group is not None:  # ends the batch on the workers, or the group if out of step
                            self.group.fail_batch(exc)
                        raise
                    if self.group is not None:
                        self.group.end_batch()
        except BaseException as raised:
            # A step may raise anything, SystemExit and KeyboardInterrupt included (signals only reach the main
            # thread, so here they always come from model or plugin code): the jobs fail with a reason and the
            # worker carries on, instead of jobs that stay "running" forever behind a dead or stuck worker.
            error: BaseException = raised if isinstance(raised, Exception) else StepAborted(raised)
            logger.error("batch of %d request(s) failed", len(members), exc_info=raised)
            if self.group is not None:  # a dead worker becomes one clear error naming the rank
                error = self.group.explain(error)
            for job in members:
                job.finish("failed", error=error, on_finish=self._counter("jobs_failed"))

    # ------------------------------------------------------------------ internals
    def _count(self, name: str, n: int = 1) -> None:
        with self.stats.lock:
            setattr(self.stats, name, getattr(self.stats, name) + n)

    def _counter(self, name: str) -> Callable[[], None]:
        return lambda: self._count(name)

    def _announce(self, kind: str, *args: object) -> None:
        if self.group is not None:
            self.group.announce(kind, *args)

    def _cancel_if_requested(self, job: Job) -> bool:
        if job.cancel_requested:
            job.finish("cancelled", on_finish=self._counter("jobs_cancelled"))
            return True
        return job.done

    def _run(self, members: list[Job]) -> None:
        pipeline, platform = self.pipeline, self.platform
        platform.reset_peak_memory()
        timings: dict[str, float] = {}
        batch_start = time.perf_counter()
        for job in members:
            job.emit("encode")
        t = time.perf_counter()
        requests = [j.request for j in members]
        # each request's adapters resolved once (file and version): the versions every rank of a group uploads
        refs = self.lora.refs(requests) if self.lora is not None else []
        self._adapters = {r.request_id: group for r, group in zip(requests, refs)}
        if any(refs):
            self._announce("batch", requests, refs)
            if self.group is not None:
                self.group.collect()  # every worker uploaded them, or this raises its error
        else:
            self._announce("batch", requests)
        # over a worker group every rank then reports how its encode ended (it may run collectives)
        settled = self.group.encoding() if self.group is not None else contextlib.nullcontext()
        try:  # a stage with a loop of its own (a model writing text first) checks and reports between iterations
            with settled, self._encode_scope(members):
                self._set_loras(members)
                state = pipeline.encode([j.request for j in members])
        except Cancelled:
            for job in members:
                job.finish("cancelled", on_finish=self._counter("jobs_cancelled"))
            return
        platform.synchronize()
        timings["encode_s"] = time.perf_counter() - t
        total = int(state.num_steps)
        # a re-claimed job with a step checkpoint (engine.step_checkpoint) starts where that one ended
        state, start = resume_point(pipeline, state, members) if self.group is None else (state, 0)
        t = denoise_start = time.perf_counter()
        for step in range(start, total):
            state, members = self._drop_cancelled(state, members)
            if all(j.done for j in members):
                return
            self._announce("step", step)
            self._set_loras(members)
            new_state = self.host.denoise(pipeline=pipeline, state=state, step=step)
            if new_state is None:
                raise RuntimeError(f"omnicore_denoise returned None at step {step}")
            state = new_state
            self._count("steps_executed")
            platform.synchronize()
            done = step + 1
            per_step = (time.perf_counter() - denoise_start) / (done - start)
            for job in members:
                job.emit("denoise", step=done, total_steps=total, eta_s=per_step * (total - done))
            if self.group is None:
                save_due(pipeline, state, members, done)
        timings["denoise_s"] = time.perf_counter() - t
        state, members = self._drop_cancelled(state, members)
        if all(j.done for j in members):
            return
        for job in members:
            job.emit("decode", step=total, total_steps=total)
        # filled by step caches (DenoiseState.reused_steps); None: the enabled cache decides where the engine cannot
        # see it (diffusers' hook caches), so the count is unknown rather than 0
        steps_reused = getattr(state, "reused_steps", ())
        reused = None if steps_reused is None else len(steps_reused)
        # the steps are over on every rank; a pipeline whose decode shares tiles over the ranks
        # (omnicore.parallel.vae_decode) decodes on every rank, so rank 0 alone must not leave it half-way
        every_rank = self.group is not None and bool(getattr(pipeline, "decode_on_every_rank", False))
        self._announce("decode", every_rank)
        t = time.perf_counter()
        try:  # a chunked decode checks between chunks (engine.cancellation), so DELETE stops it within seconds
            with (contextlib.nullcontext() if every_rank
                  else cancel_scope(lambda: all(j.cancel_requested or j.done for j in members))):
                outputs = pipeline.decode(state)
        except Cancelled:
            for job in members:
                job.finish("cancelled", on_finish=self._counter("jobs_cancelled"))
            return
        platform.synchronize()
        timings["decode_s"] = time.perf_counter() - t
        per_job = self._split(outputs, members)
        peak = platform.max_memory_allocated()  # the batch's peak window, or None where it cannot be measured
        batch_outputs = len(outputs)
        for job, job_outputs in zip(members, per_job):
            if job.done:  # cancelled while its rows were computed with the others
                continue
            job.emit("postprocess", step=total, total_steps=total)
            finished = []
            for i, out in enumerate(job_outputs):
                t = time.perf_counter()
                self._stamp(job, i, out)
                result = self.host.postprocess(request=job.request, output=out)
                out = result if result is not None else out
                out.metrics.update(timings)
                out.metrics.update(job.metrics)
                out.metrics.update({
                    "postprocess_s": time.perf_counter() - t, "steps": total, "cache_reused_steps": reused,
                    "batch_requests": len(members),
                    "batch_outputs": batch_outputs, "peak_memory_bytes": peak,
                    "total_s": time.perf_counter() - batch_start + job.metrics.get("queue_s", 0.0)
                    + job.metrics.get("preprocess_s", 0.0),
                })
                finished.append(out)
            job.finish("succeeded", outputs=finished, on_finish=self._counter("jobs_succeeded"))

    @contextlib.contextmanager
    def _encode_scope(self, members: list[Job]) -> Iterator[None]:
        """Progress reports and cancellation points inside ``encode``. Over a worker group only progress: the
        other ranks run the same loop with collectives in it, so rank 0 alone must not leave it (cancellation
        then takes effect at the first denoise step, where every rank checks it)."""

        def report(phase: str, done: int, total: int, row: int | None) -> None:
            for job in members if row is None else members[row:row + 1]:
                job.emit(phase, step=done, total_steps=total)

        with stage_progress_scope(report):
            if self.group is not None:
                yield
                return
            with cancel_scope(lambda: all(j.cancel_requested or j.done for j in members)):
                yield

    def _set_loras(self, members: list[Job]) -> None:
        if self.lora is not None:
            requests = [j.request for j in members]
            self.lora.activate(requests, [self._adapters.get(r.request_id, ()) for r in requests])

    def _drop_cancelled(self, state: DenoiseState, members: list[Job]) -> tuple[DenoiseState, list[Job]]:
        cancelled = [j for j in members if j.cancel_requested and not j.done]
        if not cancelled:
            return state, members
        for job in cancelled:
            job.finish("cancelled", on_finish=self._counter("jobs_cancelled"))
        keep = [i for i, j in enumerate(members) if not j.done]
        if not keep or len(keep) == len(members):
            return state, members
        self._announce("select", keep)
        shrunk = self.pipeline.select_requests(state, keep)
        if shrunk is None:  # cannot shrink: keep computing the cancelled rows and discard them at the end
            return state, members
        return shrunk, [members[i] for i in keep]

    @staticmethod
    def _split(outputs: list[Output], members: list[Job]) -> list[list[Output]]:
        expected = sum(j.request.params.num_outputs for j in members)
        if len(outputs) != expected:
            raise RuntimeError(f"decode returned {len(outputs)} outputs for a batch expecting {expected}")
        groups, i = [], 0
        for job in members:
            n = job.request.params.num_outputs
            groups.append(list(outputs[i:i + n]))
            i += n
        return groups

    @staticmethod
    def _stamp(job: Job, index: int, out: Output) -> None:
        out.request_id = out.request_id or job.id
        out.index = index
        if out.seed is None and job.request.params.seed is not None:
            out.seed = job.request.params.seed + index
