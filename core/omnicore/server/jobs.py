"""The job manager: owns job execution between the HTTP edge and the engine.

Routes never run GPU work: they hand a validated ``GenerationRequest`` to :meth:`JobManager.submit` (called
in a worker thread, because the engine runs ``preprocess`` in the caller's thread). A watcher thread per job
waits for the engine, applies the opt-in deadline, writes results atomically and records the terminal
status; HTTP handlers only await it. A client that stops polling never affects a job.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from .. import errors as core_errors
from ..engine.limits import WorkLimits
from ..jobstore.base import LeaseLost
from ..outputs.options import EncodeOptions
from .errors import ApiError, from_core, is_storage_full, job_error_code
from .metrics import Metrics, observe_stages
from .progress import api_phase, phase_fraction, weighted_progress
from .settings import ServerSettings
from .sse import EventHub
from .store import JobStore

logger = logging.getLogger("omnicore.server")

PROGRESS_KEYS = ("status", "phase", "phase_progress", "step", "total_steps", "progress", "updated_at")
_STARTED = ("encode", "think", "denoise", "decode", "postprocess")  # engine phases that mean the worker has the job
ANONYMOUS = "none"  # the key id label of jobs submitted while auth is off


@attrs.define(eq=False)
class LiveJob:
    """In-memory state of one admitted job (active or just finished)."""

    id: str
    kind: str  # "video" (persisted) | "image" | "sync"
    task: str
    persisted: bool
    deadline_s: float | None = None
    engine_job: Any = None
    status: str = "queued"  # API status
    phase: str | None = "queued"
    phase_progress: float | None = None
    step: int | None = None
    total_steps: int | None = None
    progress: int = 0
    cancel_requested: bool = False
    cancel_reason: str | None = None
    cancel_t0: float | None = None
    outputs: list[Any] = attrs.Factory(list)
    error: BaseException | None = None
    error_code: str | None = None
    created: float = attrs.Factory(time.time)
    started: float | None = None
    done: threading.Event = attrs.Factory(threading.Event)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = attrs.Factory(list)
    finishing: bool = False
    step_clock: float | None = None
    timer: threading.Timer | None = None  # the client's timeout_s, from submission
    run_timer: threading.Timer | None = None  # the operator's --max-job-seconds, from the start of running
    on_event: Callable[[Any], None] | None = None  # also sees every engine event, from submission on (streams)
    owner: str | None = None  # key id of the API key that submitted it (auth.key_id); None without auth
    fence: int | None = None  # lease token of a job claimed from a shared store: every write of it carries it
    lease_lost: bool = False  # a fenced write was rejected: another replica holds the job now; write nothing more
    model: str | None = None  # the model it is for, when the server serves several (a model pool); else None
    checkpoint_step: int | None = None  # the step of the last step checkpoint this replica wrote for it


@attrs.define
class _Unwritten:
    """A terminal status the store could not take (disk full): kept in memory and retried with backoff."""

    changes: dict[str, Any]
    delay_s: float
    next_try: float
    attempts: int = 1


@attrs.define
class KeyUsage:
    """What one API key (by key id) used since this server process started."""

    jobs: dict[str, int] = attrs.Factory(dict)  # terminal status -> count
    denoise_steps: int = 0
    compute_seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"jobs": dict(self.jobs), "jobs_total": sum(self.jobs.values()), "denoise_steps": self.denoise_steps,
                "compute_seconds": round(self.compute_seconds, 4)}


class JobManager:
    """Admits jobs into the engine, tracks them, and records how each one ends.

    A monitor thread ticks every ``heartbeat_interval_s``: it advances the heartbeat of running jobs, checks
    that the engine worker is alive (a dead one fails every active job with ``worker_died`` and calls
    ``on_worker_died``), and removes finished jobs whose TTL ran out.
    """

    def __init__(self, engine: Any, store: JobStore, settings: ServerSettings, metrics: Metrics,
                 hub: EventHub, on_worker_died: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self.hub = hub
        self.on_worker_died = on_worker_died
        self.on_released: Callable[[LiveJob], None] | None = None  # a replica's claimer frees the job's slot
        self.worker_error: str | None = None
        self._lock = threading.Lock()
        self._live: dict[str, LiveJob] = {}
        self._durations: deque[float] = deque(maxlen=32)
        self._unwritten: dict[str, _Unwritten] = {}  # job id -> terminal changes the store refused (disk full)
        self._usage: dict[str, KeyUsage] = {}  # key id (ANONYMOUS without auth) -> usage since start
        self._stopping = False
        self._drain_t0 = 0.0
        self._finisher = ThreadPoolExecutor(max_workers=4, thread_name_prefix="omnicore-finish")
        self._monitor_stop = threading.Event()
        self._monitor = threading.Thread(target=self._monitor_loop, name="omnicore-monitor", daemon=True)
        self._monitor.start()
        # The server's budget; the engine checks it (with the model's own limits) on the resolved request.
        self.limits = WorkLimits(max_pixels=settings.max_image_pixels,
                                 max_work=getattr(settings, "max_work", 0) or None,
                                 source="the server")

    # ------------------------------------------------------------------ admission
    @property
    def active(self) -> int:
        with self._lock:
            return sum(1 for j in self._live.values() if not j.done.is_set())

    def retry_after_s(self) -> int:
        """Estimated wait before a slot frees up: the mean recent job duration, at least 1 s."""
        if not self._durations:
            return 1
        return max(1, math.ceil(sum(self._durations) / len(self._durations)))

    def get_live(self, job_id: str) -> LiveJob | None:
        with self._lock:
            return self._live.get(job_id)

    def queue_position(self, job_id: str) -> int | None:
        with self._lock:
            queued = [j for j in self._live.values() if j.status == "queued" and not j.done.is_set()]
        queued.sort(key=lambda j: j.created)
        for i, j in enumerate(queued):
            if j.id == job_id:
                return i
        return None

    def submit(self, live: LiveJob, request: Any) -> LiveJob:
        """Admit ``live`` and hand ``request`` to the engine. Blocking (runs preprocess): call from a thread.

        Raises :class:`ApiError` (429 when queued + running work is at ``max_queued_jobs``, 400 when the
        model rejects the request, 503 when the engine is closed).
        """
        with self._lock:
            if self.worker_error is not None:
                raise ApiError(503, "worker_unavailable", f"the engine worker died: {self.worker_error}",
                               headers={"Retry-After": "30"})
            if self._stopping:
                raise ApiError(503, "draining", "the server is shutting down", headers={"Retry-After": "5"})
            active = sum(1 for j in self._live.values() if not j.done.is_set())
            if active >= self.settings.max_queued_jobs:
                raise ApiError(429, "queue_full",
                               f"queued plus running work is at the limit ({self.settings.max_queued_jobs}); "
                               "retry later", headers={"Retry-After": str(self.retry_after_s())})
            self._live[live.id] = live
        try:
            routed: dict[str, Any] = {"model": live.model} if live.model is not None else {}  # a pool routes by it
            plan = self._checkpoint_plan(live)
            if plan is not None:
                routed["checkpoint"] = plan
            job = self.engine.submit(request, on_event=lambda ev: self._on_event(live, ev), limits=self.limits,
                                     **routed)
        except BaseException as exc:
            with self._lock:
                self._live.pop(live.id, None)
            raise from_core(exc, retry_after_s=self.retry_after_s()) from exc
        live.engine_job = job
        if live.cancel_requested:  # cancelled while preprocess ran
            job.cancel()
        # Two clocks. The client's own deadline (timeout_s, failing with "timeout") counts from submission, queue
        # time included: it is what the caller is willing to wait. The operator's --max-job-seconds (failing with
        # "server_timeout") counts running time only, from the moment the worker starts the job (armed in
        # _on_event): a job is not blamed for the time it waited behind others.
        if live.deadline_s is not None:
            live.timer = _start_timer(live.deadline_s, self.cancel, live.id, "timeout")
        # Terminal events arrive on the engine worker; finishing (writing an MP4) runs on our own pool.
        job.add_listener(lambda ev: self._on_terminal(live, ev), replay=True)
        return live

    # ------------------------------------------------------------------ step checkpoints (shared store)
    def _checkpoint_plan(self, live: LiveJob) -> Any:
        """Step checkpoints of a job claimed from a shared store with ``--checkpoint-every K`` (not through a model
        pool): save every K steps, and resume from the job's last checkpoint when an earlier holder left one."""
        every = int(getattr(self.settings, "checkpoint_every", 0) or 0)
        if live.fence is None or live.model is not None or every < 1:
            return None
        from ..engine.step_checkpoint import CheckpointPlan, StepStateError, read_snapshot

        resume = None
        found = self.store.get_checkpoint(live.id)
        if found is not None:
            try:
                resume = read_snapshot(found[0])
            except StepStateError as exc:  # a partial or foreign file: run from step 0 rather than fail
                logger.warning("job %s: %s; starting at step 0", live.id, exc)
        return CheckpointPlan(every=every, save=lambda snap: self._save_checkpoint(live, snap), resume=resume)

    def _save_checkpoint(self, live: LiveJob, snapshot: Any) -> None:
        """Write ``snapshot`` under this claim's token and record it, fenced: a holder whose lease is gone leaves
        neither the files nor the record (and stops the job here)."""
        from ..engine.step_checkpoint import snapshot_files, write_snapshot

        if live.lease_lost or live.fence is None:
            return
        index = write_snapshot(snapshot, self.store.checkpoint_stem(live.id, live.fence, snapshot.step))
        try:
            self.store.set_checkpoint(live.id, live.fence, index, snapshot.step)
        except LeaseLost as exc:
            for path in snapshot_files(index):
                path.unlink(missing_ok=True)
            logger.warning("job %s: %s; stopping it on this replica", live.id, exc)
            self.lose_lease(live)
            return
        self.store.remove_checkpoints(live.id, token=live.fence, keep=index)  # this claim's earlier steps
        live.checkpoint_step = snapshot.step

    def _drop_checkpoints(self, live: LiveJob) -> None:
        """The job ended here: its checkpoints go. A job that went back to the queue or to another replica (lease
        lost) keeps them: its next holder resumes from the recorded one, and removes them all when it ends."""
        if live.fence is None or live.status == "queued" or live.lease_lost \
                or not getattr(self.settings, "checkpoint_every", 0):
            return
        try:
            self.store.remove_checkpoints(live.id)
        except Exception:
            logger.exception("job %s: removing its step checkpoints failed", live.id)

    # ------------------------------------------------------------------ progress (engine threads)
    def _on_event(self, live: LiveJob, ev: Any) -> None:
        if live.on_event is not None:
            live.on_event(ev)
        if ev.terminal:
            return  # the finisher records terminal states after the results are written
        job = live.engine_job
        if live.status == "queued" and (ev.phase in _STARTED or (job is not None and job.status == "running")):
            live.status = "in_progress"
            live.started = time.time()
            operator = self.settings.max_job_seconds
            if operator > 0 and live.run_timer is None:  # the operator deadline: running time only
                live.run_timer = _start_timer(operator, self.cancel, live.id, "operator_deadline")
        phase = api_phase(ev.phase) if live.status == "in_progress" else "loading" if ev.phase == "loading" \
            else "queued"  # (a model pool's job waits for its model to load in the visible `loading` phase)
        prev_step = live.step or 0
        if ev.total_steps and ev.phase != "think":  # think counts tokens; step/total_steps stay denoise steps
            live.step, live.total_steps = ev.step, ev.total_steps
        if phase == "encode":
            live.step_clock = time.perf_counter()
        if phase == "denoise" and ev.step > prev_step:
            n, now_t = ev.step - prev_step, time.perf_counter()
            self.metrics.steps.labels(result="computed").inc(n)
            if live.step_clock is not None:
                for _ in range(n):
                    self.metrics.step.observe((now_t - live.step_clock) / n)
            live.step_clock = now_t
        self._set_phase(live, phase, phase_fraction(phase, ev.step, ev.total_steps))

    def _set_phase(self, live: LiveJob, phase: str, fraction: float | None) -> None:
        """Record a phase change or step: in memory, in the store and on the job's event stream."""
        live.phase, live.phase_progress = phase, fraction
        live.progress = max(live.progress, weighted_progress(phase, fraction))
        if not live.persisted:
            return
        now = int(time.time())
        changes: dict[str, Any] = {"status": live.status, "phase": phase, "phase_progress": fraction,
                                   "step": live.step, "total_steps": live.total_steps, "progress": live.progress,
                                   "updated_at": now, "queue_position": None}
        if live.status == "in_progress" and live.started is not None:
            changes["started_at"] = int(live.started)
        record = self._write(live, **changes)
        if live.lease_lost:
            return
        if live.fence is not None and record is not None and record.get("cancel_requested") \
                and not live.cancel_requested:  # DELETE or cancel through another replica: stop at this step
            self.cancel(live.id, reason="a request through another replica")
        self.hub.publish(live.id, "video.progress", {"id": live.id, **{k: changes[k] for k in PROGRESS_KEYS}})

    def _write(self, live: LiveJob, **changes: Any) -> dict[str, Any] | None:
        """Write ``changes`` to ``live``'s record, fenced by its lease token when it was claimed from a shared
        store. A rejected write (another replica re-claimed the job) writes nothing and stops the job here."""
        if live.lease_lost:
            return None
        if live.fence is None:
            return self.store.update(live.id, **changes)
        try:
            return self.store.update(live.id, fence=live.fence, **changes)
        except LeaseLost as exc:
            logger.warning("job %s: %s; stopping it on this replica", live.id, exc)
            self.lose_lease(live)
            return None

    def lose_lease(self, live: LiveJob) -> None:
        """``live``'s lease is gone (expired and re-claimed, or cancelled elsewhere): stop it, write nothing."""
        if live.lease_lost:
            return
        live.lease_lost = True
        live.cancel_requested, live.cancel_reason = True, "lease lost"
        if live.engine_job is not None:
            live.engine_job.cancel()

    # ------------------------------------------------------------------ monitor (heartbeat, liveness, TTL)
    def _monitor_loop(self) -> None:
        while not self._monitor_stop.wait(self.settings.heartbeat_interval_s):
            for task in (self._check_worker, self._retry_unwritten, self._heartbeat, self._expire):
                try:
                    task()
                except Exception:  # the monitor must never die
                    logger.exception("job monitor: %s failed", task.__name__)

    def _heartbeat(self) -> None:
        now = int(time.time())
        with self._lock:
            jobs = [j for j in self._live.values() if j.persisted and not j.done.is_set()]
        for j in jobs:
            if j.status == "in_progress":
                self._write(j, updated_at=now)
            self.hub.publish(j.id, "video.heartbeat", {"id": j.id, "phase": j.phase, "updated_at": now})

    def _expire(self) -> None:
        for job_id in self.store.expire(self.settings.job_ttl_s):
            self.hub.forget(job_id)

    def _check_worker(self) -> None:
        """A dead engine worker fails its jobs with ``worker_died`` and makes the server unhealthy."""
        if self.worker_error is not None or self._stopping or getattr(self.engine, "worker_alive", True):
            return  # (while draining, the engine's worker stops on purpose)
        # a parallel engine names the rank that died (Engine.worker_failure); otherwise the thread itself stopped
        self.worker_error = (getattr(self.engine, "worker_failure", None)
                             or "the engine worker thread is no longer running")
        logger.error("engine worker died; failing active jobs")
        with self._lock:
            jobs = [j for j in self._live.values() if not j.done.is_set() and not j.finishing]
            for j in jobs:
                j.finishing = True  # the engine will never report these jobs' ends
        for j in jobs:
            j.status, j.error_code = "failed", "worker_died"
            j.error = RuntimeError(self.worker_error)
            if j.engine_job is not None:
                j.engine_job.cancel()
            if j.persisted:
                self._record_terminal(j, "failed", {"code": "worker_died", "message": self.worker_error})
            self.metrics.jobs.labels(task=j.task, status="failed").inc()
            self._account(j, j.engine_job)
            self._release(j)
        if self.on_worker_died is not None:
            self.on_worker_died(self.worker_error)

    # ------------------------------------------------------------------ completion (watcher threads)
    def _on_terminal(self, live: LiveJob, ev: Any) -> None:
        if ev.phase not in ("done", "failed", "cancelled") or live.finishing:
            return
        live.finishing = True
        self._finisher.submit(self._finish_safe, live)

    def _finish_safe(self, live: LiveJob) -> None:
        job = live.engine_job
        for timer in (live.timer, live.run_timer):
            if timer is not None:
                timer.cancel()
        try:
            self._finish(live, job)
        except Exception as exc:  # a full disk, or a bug, while finishing must still end the job, with a reason
            full = is_storage_full(exc)
            logger.error("finishing job %s failed%s", live.id, " (storage full)" if full else "", exc_info=exc)
            live.status, live.error, live.error_code = "failed", exc, "storage_full" if full else "internal_error"
            live.outputs = []
            message = (f"the result could not be stored: the server's storage is full ({type(exc).__name__}: {exc})"
                       if full else f"{type(exc).__name__}: {exc}")
            try:
                if live.persisted:  # written now, or kept and retried with backoff until the disk has room
                    self._record_terminal(live, "failed", {"code": live.error_code, "message": message})
                self.metrics.jobs.labels(task=live.task, status="failed").inc()
                self._account(live, job)
            except Exception:  # pragma: no cover - the job still ends below
                logger.exception("recording the failure of job %s failed", live.id)
        finally:
            self._drop_checkpoints(live)
            self._release(live)

    def _finish(self, live: LiveJob, job: Any) -> None:
        now = time.time()
        if live.lease_lost:  # another replica holds the job now: this one records nothing
            live.status = "cancelled"
            return
        if live.cancel_t0 is not None:
            self.metrics.cancel_latency.observe(now - live.cancel_t0)
        if job.status == "succeeded":
            live.outputs = list(job.outputs)
            if live.persisted:
                self._complete_video(live, job)
            live.status = "completed"
        elif job.status == "cancelled" and self._stopping and live.cancel_reason in (None, "shutdown") \
                and live.status == "queued" and live.persisted:
            live.status = "queued"  # never started: stays queued in the store and is re-enqueued on restart
            if live.fence is not None:  # (a shared store: back to the queue now, for the other replicas)
                self.store.release(live.id, live.fence)
            return
        elif job.status == "cancelled":
            if live.cancel_reason == "timeout":
                live.status, live.error_code = "failed", "timeout"
                message = f"the job exceeded its timeout_s ({live.deadline_s:g} s) and was stopped"
            elif live.cancel_reason == "operator_deadline":
                live.status, live.error_code = "failed", "server_timeout"
                message = (f"the job ran longer than this server allows (--max-job-seconds "
                           f"{self.settings.max_job_seconds:g} s of running time) and was stopped")
            elif self._stopping and live.cancel_reason in (None, "shutdown") and live.fence is not None \
                    and self.store.release(live.id, live.fence):
                live.status = "queued"  # a shared store: another replica runs it again (from its last checkpoint)
                return
            elif self._stopping and live.cancel_reason in (None, "shutdown"):
                live.status, live.error_code = "failed", "interrupted"
                message = "the server shut down while this job was running"
            else:
                live.status, live.error_code = "cancelled", "cancelled"
                message = f"cancelled by {live.cancel_reason or 'request'}"
            live.error = core_errors.Cancelled(live.id)
            if live.persisted:
                self._record_terminal(live, live.status, {"code": live.error_code, "message": message})
        else:
            live.status, live.error = "failed", job.error
            live.error_code = job_error_code(job.error)
            message = f"{type(job.error).__name__}: {job.error}"
            if live.error_code == "out_of_memory":  # the message names the phase that ran out
                message = f"out of memory in phase {live.phase or 'unknown'}: {message}"
            if live.persisted:
                self._record_terminal(live, "failed", {"code": live.error_code, "message": message})
        self.metrics.jobs.labels(task=live.task, status=live.status).inc()
        self._account(live, job)
        if job.started_at and job.finished_at:
            queued_s = max(0.0, job.started_at - job.created_at)
            self.metrics.stage.labels(stage="queued").observe(queued_s)
            self._durations.append(job.finished_at - job.started_at)
            if live.outputs:
                timings = {**(job.metrics or {}), **live.outputs[0].metrics}
                observe_stages(self.metrics, timings, max(0.0, time.time() - live.created - queued_s))
                peak = timings.get("peak_memory_bytes")
                if isinstance(peak, (int, float)):
                    device = getattr(getattr(self.engine, "platform", None), "name", None) or "device"
                    self.metrics.device_peak.labels(device=str(device)).set(peak)

    def timings(self, live: LiveJob, job: Any, completed: float, save_s: float) -> dict[str, float]:
        """The ``timings`` object of videos and images alike: seconds per contract stage (``queued_s``,
        ``preprocess_s``, ``encode_s``, ``denoise_s``, ``decode_s``, ``encode_output_s``, ``finalize_s``,
        ``total_s``), from the engine's and our own clocks; ``save_s`` is the time spent encoding the result."""
        metrics = {**(job.metrics or {}), **(live.outputs[0].metrics if live.outputs else {})}

        def sec(key: str) -> float:
            value = metrics.get(key)
            return float(value) if isinstance(value, (int, float)) else 0.0

        timings = {"queued_s": max(0.0, (job.started_at or job.created_at) - job.created_at),
                   "preprocess_s": sec("preprocess_s"), "encode_s": sec("encode_s"), "denoise_s": sec("denoise_s"),
                   "decode_s": sec("decode_s"), "encode_output_s": sec("postprocess_s") + save_s,
                   "finalize_s": max(0.0, time.time() - completed), "total_s": completed - live.created}
        return {k: round(v, 4) for k, v in timings.items()}

    def _complete_video(self, live: LiveJob, job: Any) -> None:
        out = live.outputs[0]
        if out.fps is None:  # a one-frame clip from a model that only stamps fps on multi-frame output
            out = attrs.evolve(out, kind="video", fps=job.request.params.fps)
        self._set_phase(live, "encode_output", 0.0)
        t0 = time.perf_counter()
        ext = "mp4" if live.fence is None else f"{live.fence}.mp4"  # per claim: a stale holder never overwrites
        path = out.save(self.store.result_path(live.id, ext), EncodeOptions(durable=True))  # temp, fsync, rename
        save_s = time.perf_counter() - t0
        try:
            self._set_phase(live, "finalize", 0.0)
        except Exception:
            path.unlink(missing_ok=True)  # the record cannot say completed: no orphan result
            raise
        self.metrics.stage.labels(stage="encode_output").observe(save_s)
        t_final = time.perf_counter()
        completed = time.time()
        ttl = self.settings.job_ttl_s
        params = job.request.params
        fps = out.fps if out.fps is not None else params.fps
        # the length of the video written, which the model's frame rule may make longer than the request asked
        # (H3 at 4 s writes 107 frames at 24 fps: 4.46 s); the request's own value is kept in the stored body
        seconds = f"{out.num_frames / fps:.3g}" if out.num_frames and fps else None
        resumed = int(out.metrics.get("resumed_from_step", 0) or 0)  # a step checkpoint's step, when it resumed
        try:
            record = self._write(
                live, result_path=path, status="completed", phase=None, phase_progress=None, progress=100,
            completed_at=int(completed),
            updated_at=int(completed), expires_at=int(completed + ttl) if ttl > 0 else None, cancel_requested=False,
            seed=out.seed if out.seed is not None else params.seed, num_frames=out.num_frames,
            fps=fps, size=f"{out.width}x{out.height}", **({"seconds": seconds} if seconds else {}),
            step=live.total_steps, total_steps=live.total_steps, timings=self.timings(live, job, completed, save_s),
            usage={"denoise_steps_computed": (live.total_steps or 0) - resumed,
                   **({"resumed_from_step": resumed} if resumed else {}),
                   "denoise_steps_cached": int(out.metrics.get("denoise_steps_cached", 0) or 0),
                   "peak_device_memory_bytes": out.metrics.get("peak_memory_bytes")},
            )
        except Exception:
            path.unlink(missing_ok=True)  # not recorded as completed: the result goes too (the job fails)
            raise
        if live.lease_lost:  # the completion was rejected: the job is another replica's now
            path.unlink(missing_ok=True)
            return
        self.metrics.stage.labels(stage="finalize").observe(time.perf_counter() - t_final)
        if record is not None:
            self.hub.publish(live.id, "video.completed", record, final=True)

    def _record_terminal(self, live: LiveJob, status: str, error: dict[str, str]) -> None:
        """Write the terminal status and end the job's event streams. When the store cannot take the write
        (disk full), the status is kept in memory, served by :meth:`unwritten` to readers, and retried with
        backoff by the monitor until it is written: a job never stays ``in_progress`` because of a full disk."""
        now = int(time.time())
        ttl = self.settings.job_ttl_s
        changes: dict[str, Any] = {"status": status, "error": error, "updated_at": now, "completed_at": None,
                                   "expires_at": now + int(ttl) if ttl > 0 else None, "queue_position": None,
                                   "cancel_requested": False, "phase": None, "phase_progress": None}
        try:
            record = self._write(live, **changes)
            if live.lease_lost:
                return
        except Exception as exc:
            logger.error("job %s: could not record status %s (%s: %s); retrying with backoff", live.id, status,
                         type(exc).__name__, exc)
            with self._lock:
                self._unwritten[live.id] = _Unwritten(changes, delay_s=1.0, next_try=time.monotonic() + 1.0)
            try:
                stored = self.store.get(live.id)  # reads usually still work on a full disk
            except Exception:
                stored = None
            record = {**(stored or {"id": live.id, "object": "video"}), **changes}
        if record is not None:
            self.hub.publish(live.id, f"video.{status}", record, final=True)

    def unwritten(self, job_id: str) -> dict[str, Any] | None:
        """The terminal changes of ``job_id`` that the store has not taken yet (``None`` when there are none)."""
        with self._lock:
            entry = self._unwritten.get(job_id)
        return dict(entry.changes) if entry is not None else None

    def _retry_unwritten(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [(job_id, e) for job_id, e in self._unwritten.items() if e.next_try <= now]
        for job_id, entry in due:
            try:
                self.store.update(job_id, **entry.changes)
            except Exception as exc:
                entry.attempts += 1
                entry.delay_s = min(entry.delay_s * 2, 60.0)
                entry.next_try = time.monotonic() + entry.delay_s
                logger.warning("job %s: status still not written after %d attempts (%s); next try in %.0f s",
                               job_id, entry.attempts, exc, entry.delay_s)
                continue
            logger.info("job %s: status %s written after %d attempts", job_id, entry.changes.get("status"),
                        entry.attempts + 1)
            with self._lock:
                self._unwritten.pop(job_id, None)
            if self.store.delete_pending(job_id):
                self.store.delete(job_id)

    # ------------------------------------------------------------------ usage per API key
    def _account(self, live: LiveJob, job: Any) -> None:
        """Count a finished job against the key that submitted it: status, denoise steps, compute seconds
        (the job's running wall time on the worker; jobs batched together each count the batch's time)."""
        key = live.owner or ANONYMOUS
        steps = live.total_steps if live.status == "completed" else (live.step or 0)
        compute = 0.0
        if job is not None and getattr(job, "started_at", None):
            compute = max(0.0, (job.finished_at or time.time()) - job.started_at)
        with self._lock:
            usage = self._usage.setdefault(key, KeyUsage())
            usage.jobs[live.status] = usage.jobs.get(live.status, 0) + 1
            usage.denoise_steps += int(steps or 0)
            usage.compute_seconds += compute
        self.metrics.key_jobs.labels(key_id=key, status=live.status).inc()
        self.metrics.key_steps.labels(key_id=key).inc(int(steps or 0))
        self.metrics.key_compute.labels(key_id=key).inc(compute)

    def usage(self, key: str | None) -> dict[str, Any]:
        """The usage of one key id (``None``: calls made without auth) since this process started."""
        with self._lock:
            found = self._usage.get(key or ANONYMOUS)
            return (found or KeyUsage()).as_dict()

    def _release(self, live: LiveJob) -> None:
        try:
            if live.persisted and not live.lease_lost and live.id not in self._unwritten \
                    and self.store.delete_pending(live.id):
                self.store.delete(live.id)
        except Exception:  # the job still ends (its waiters wake) when the store is unusable
            logger.exception("job %s: deleting the record after DELETE failed", live.id)
        live.done.set()
        with self._lock:
            self._live.pop(live.id, None)
            waiters, live.waiters = live.waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:
                pass
        if self.on_released is not None:
            self.on_released(live)

    # ------------------------------------------------------------------ control (any thread)
    def cancel(self, job_id: str, reason: str = "client request") -> bool:
        """Ask the job to stop at the next step boundary; ``False`` when it is not active here."""
        live = self.get_live(job_id)
        if live is None or live.done.is_set():
            return False
        if not live.cancel_requested:
            live.cancel_requested = True
            live.cancel_reason = reason
            live.cancel_t0 = time.time()
            if live.persisted:
                self._write(live, cancel_requested=True, updated_at=int(time.time()))
        if live.engine_job is not None:
            live.engine_job.cancel()
        return True

    async def wait(self, live: LiveJob, timeout: float | None = None) -> bool:
        """Await the job's end without blocking the loop; ``False`` when ``timeout`` passed first."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            if live.done.is_set():
                return True
            live.waiters.append((loop, fut))
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ------------------------------------------------------------------ shutdown
    def begin_drain(self) -> None:
        """Stop admitting, and take persisted queued jobs out of the engine's queue: they stay ``queued`` in
        the store and run after a restart. Running work carries on. Idempotent; any thread."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            self._drain_t0 = time.monotonic()
            held = [j for j in self._live.values() if j.persisted and j.status == "queued" and not j.done.is_set()]
        for j in held:
            j.cancel_requested, j.cancel_reason = True, "shutdown"  # in memory only: the record stays queued
            if j.engine_job is not None:
                j.engine_job.cancel()

    def shutdown(self, grace_s: float) -> None:
        """Drain (see :meth:`begin_drain`), let running work finish until ``grace_s`` after the drain began,
        then stop it at the next step (it fails with ``interrupted``). Blocking."""
        self.begin_drain()
        end = self._drain_t0 + grace_s
        with self._lock:
            jobs = list(self._live.values())
        for j in jobs:
            j.done.wait(max(0.0, end - time.monotonic()))
        late = [j for j in jobs if not j.done.is_set()]
        for j in late:
            self.cancel(j.id, reason="shutdown")
        for j in late:
            j.done.wait(max(1.0, self.settings.cancel_wait_s))

    def stop(self) -> None:
        """After the engine closed: stop the monitor and wait for pending finishers (results written)."""
        self._monitor_stop.set()
        self._finisher.shutdown(wait=True)

    @property
    def stopping(self) -> bool:
        return self._stopping


def _start_timer(seconds: float, fn: Callable[..., Any], *args: Any) -> threading.Timer:
    timer = threading.Timer(seconds, fn, args=args)
    timer.daemon = True
    timer.start()
    return timer


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(True)
