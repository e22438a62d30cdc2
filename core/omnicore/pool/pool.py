""":class:`ModelPool`: several :class:`~omnicore.engine.api.Engine`\\ s (one model each) under one memory budget.

Each model has its own engine, so its own queue, admission-wait batching and limits. The pool decides which
engines hold their weights on the device (``loaded``), which keep them in host memory (``offloaded``), which are
closed (``unloaded``), and which one is being brought in (``loading``). A model whose load failed is ``failed``:
its requests fail with :class:`~omnicore.errors.ModelUnavailable`, the others keep serving.

The policy, applied by one control thread (so there are never two loads at once on the device):

- **Room.** A model fits when the measured resident bytes of the ``loaded``/``loading`` models plus its own size
  (measured at its last load; before the first one, the size of its weight files) stay within the budget.
- **Victims.** To make room the pool offloads a ``loaded`` model that is not pinned (a ``parallel`` model counts as
  pinned: its worker ranks hold its weights). Idle models go first (nothing running, nothing queued), lowest
  ``priority`` first, then least recently used. A model with work is chosen only when the idle ones cannot make
  room: it is then *held* (new requests for it wait in the pool, never dropped), the work its engine already
  admitted finishes, and then it is offloaded.
- **Turns (fairness).** Models waiting for the device are served oldest waiting request first, whatever their
  priority or load. A hot model therefore cannot starve a cold one: the cold model's first request makes the hot
  model hold after its admitted work, and the hot model's requests that arrive meanwhile wait for the next turn.
- **Host memory.** Offloaded models beyond ``host_memory_budget`` are unloaded, least recently used first.

Requests for a model that is not ``loaded`` wait in the pool in the ``loading`` phase (progress events with an ETA
from the model's last load); once it is loaded they enter its engine, which preprocesses and batches them.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import attrs

from ..errors import ConfigError, EngineClosed, InvalidRequest, ModelUnavailable, QueueFull, UnknownName
from ..sizes import format_bytes
from .entries import ModelEntry, check_unique
from .memory import HostSwap, checkpoint_bytes, device_capacity, resident_bytes

if TYPE_CHECKING:
    from ..config import Settings
    from ..engine.api import Engine
    from ..engine.jobs import Job, Listener
    from ..engine.limits import WorkLimits
    from ..engine.progress import ProgressEvent
    from ..engine.request import GenerationRequest
    from ..outputs.output import Output
    from ..platforms.base import Platform
    from ..plugin_host.host import PluginHost
    from ..specs import ModelSpec

logger = logging.getLogger("omnicore.pool")

STATES = ("unloaded", "loading", "loaded", "offloaded", "failed")
#: one step of the pool's control loop (a load, an offload, a restore ...), run outside its lock
Action = Callable[[], object]
_RUNNING_PHASES = ("encode", "denoise", "decode", "postprocess")
TICK_S = 0.5  # how often waiting requests get a `loading` progress event


@attrs.define(eq=False)
class _Waiting:
    job: Job
    request: GenerationRequest
    limits: WorkLimits | None
    since: float  # monotonic


@attrs.define(eq=False)
class ModelCounters:
    """What happened to one model since the pool started (``/metrics`` exports them)."""

    loads: int = 0  # from nothing (an Engine was built)
    restores: int = 0  # offloaded -> loaded
    offloads: int = 0
    unloads: int = 0
    load_failures: int = 0
    load_seconds: float = 0.0
    restore_seconds: float = 0.0
    offload_seconds: float = 0.0
    unload_seconds: float = 0.0
    requests: int = 0


@attrs.define(eq=False)
class _Slot:
    entry: ModelEntry
    spec: ModelSpec
    path: str
    size: int  # resident bytes: measured at the last load, else the weight files' size
    measured: bool = False
    state: str = "unloaded"
    engine: Engine | None = None
    swap: HostSwap | None = None
    waiting: deque[_Waiting] = attrs.Factory(deque)
    inflight: int = 0  # handed to the engine (or being handed) and not finished
    held: bool = False  # room is needed: new requests wait in the pool
    swapping: bool = False  # an offload/unload of this model is running
    last_used: float = 0.0
    error: BaseException | None = None
    last_load_s: float | None = None
    load_started: float | None = None
    counters: ModelCounters = attrs.Factory(ModelCounters)

    @property
    def swappable(self) -> bool:
        return not self.entry.pinned and not self.entry.parallel_enabled


@attrs.frozen
class ModelStatus:
    """One model's state as :meth:`ModelPool.status` reports it."""

    name: str
    state: str
    resident_bytes: int
    size_bytes: int
    size_measured: bool
    pinned: bool
    priority: int
    queued: int  # waiting in the pool plus queued in the engine
    running: int
    error: str | None
    counters: ModelCounters


class ModelPool:
    """Serve several models from one process under one device memory budget.

    :param entries: the models (:class:`~omnicore.pool.ModelEntry`; names and aliases must be unique).
    :param memory_budget: bytes of the device the loaded models may hold (default: the device's memory).
    :param host_memory_budget: bytes of host memory offloaded models may hold (default: no limit); beyond it the
        least recently used offloaded model is unloaded.
    :param preload: load models at construction, pinned ones first, then by priority and order, as long as they
        fit (a pinned model that fails to load or to fit is an error; others become ``failed`` / stay unloaded).

    ``submit(request, model=name)`` returns a :class:`~omnicore.engine.jobs.Job` at once, whatever the model's
    state; ``generate(name, prompt, ...)`` waits for the outputs. ``close()`` closes every engine.
    """

    def __init__(self, entries: Iterable[ModelEntry], *, host: PluginHost | None = None,
                 settings: Settings | None = None, platform: str | Platform | None = None,
                 memory_budget: int | None = None, host_memory_budget: int | None = None,
                 preload: bool = True) -> None:
        from ..engine.api import _instantiate_platform
        from ..engine.loading import resolve_model

        entries = list(entries)
        check_unique(entries)
        if host is None:
            from ..plugin_host.host import default_host

            host = default_host()
        self.host = host
        self.settings = settings if settings is not None else host.settings
        self.platform = _instantiate_platform(host, platform)
        self.device = self.platform.device()
        for name, value in (("memory_budget", memory_budget), ("host_memory_budget", host_memory_budget)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ConfigError(name, f"must be a positive number of bytes, got {value!r}")
        self.memory_budget = memory_budget if memory_budget is not None else device_capacity(self.platform)
        self.host_memory_budget = host_memory_budget
        self._slots: dict[str, _Slot] = {}
        self._names: dict[str, _Slot] = {}
        for entry in entries:  # an unknown model or a missing checkpoint is a configuration error, before loading
            resolved = resolve_model(entry.checkpoint, host, self.settings)
            slot = _Slot(entry=entry, spec=resolved.spec, path=str(resolved.path),
                         size=checkpoint_bytes(resolved.path))
            self._slots[entry.name] = slot
            for n in entry.names:
                self._names[n] = slot
        self._add_unambiguous_names()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self.order: list[tuple[str, str]] = []  # (action, model) in the order the pool did them (tests, logs)
        pinned = sum(s.size for s in self._slots.values() if not s.swappable)
        if pinned > self.memory_budget:
            raise ConfigError("memory_budget", f"the pinned (and parallel) models need about {format_bytes(pinned)}, "
                                               f"more than the budget of {format_bytes(self.memory_budget)}")
        if preload:
            self._preload()
        self._control = threading.Thread(target=self._loop, name="omnicore-pool", daemon=True)
        self._control.start()
        self._ticker = threading.Thread(target=self._tick_loop, name="omnicore-pool-progress", daemon=True)
        self._ticker.start()

    def _add_unambiguous_names(self) -> None:
        """A model also answers to its checkpoint argument and to its model's own names, where no other model of
        the pool does."""
        claims: dict[str, set[str]] = {}
        for slot in self._slots.values():
            for n in (slot.entry.checkpoint, slot.spec.name, f"tiny:{slot.spec.name}", *slot.spec.aliases):
                claims.setdefault(n, set()).add(slot.entry.name)
        for n, owners in claims.items():
            if len(owners) == 1 and n not in self._names:
                self._names[n] = self._slots[next(iter(owners))]

    # ------------------------------------------------------------------ lookup
    @property
    def models(self) -> tuple[str, ...]:
        """The served model names, in configuration order."""
        return tuple(self._slots)

    def names_of(self, model: str) -> tuple[str, ...]:
        """Every name ``model`` answers to (its name first)."""
        slot = self._slot(model)
        return (slot.entry.name, *[n for n, s in self._names.items() if s is slot and n != slot.entry.name])

    def spec_of(self, model: str) -> ModelSpec:
        return self._slot(model).spec

    def entry_of(self, model: str) -> ModelEntry:
        return self._slot(model).entry

    def engine_of(self, model: str) -> Engine | None:
        """The model's engine while it has one (``loaded`` or ``offloaded``), else ``None``."""
        return self._slot(model).engine

    def _slot(self, model: str | None) -> _Slot:
        if model is None:
            return next(iter(self._slots.values()))
        slot = self._names.get(model)
        if slot is None:
            raise UnknownName("model", model, {name: "this pool" for name in self._slots},
                              hint="the request's `model` must name one of them")
        return slot

    # ------------------------------------------------------------------ admission
    def submit(self, request: GenerationRequest, *, model: str | None = None, on_event: Listener | None = None,
               limits: WorkLimits | None = None) -> Job:
        """Queue ``request`` for ``model`` (default: the first model). A loaded model preprocesses it here, so a
        bad request raises at once (as :meth:`Engine.submit` does); for a model that is not loaded the job waits
        in the ``loading`` phase and its preprocess runs once the model is in. Raises ``UnknownName``,
        ``QueueFull`` (the model's own limit), ``ModelUnavailable`` (its load failed) and ``EngineClosed``."""
        from ..engine.inputs import check_request
        from ..engine.jobs import Job
        from ..engine.request import GenerationRequest

        if not isinstance(request, GenerationRequest):
            raise InvalidRequest("request", f"must be a GenerationRequest, got {type(request).__name__}")
        slot = self._slot(model)
        request = check_request(self._with_defaults(slot, request), slot.spec)
        request = request.seeded(slot.spec.defaults.seed)
        job = Job(request, canceller=self._cancel)
        job.pool_model = slot.entry.name  # type: ignore[attr-defined]
        if on_event is not None:
            job.add_listener(on_event)
        waiting = _Waiting(job, request, limits, time.monotonic())
        with self._cond:
            if self._closed:
                raise EngineClosed("the model pool is closed")
            if slot.state == "failed":
                raise ModelUnavailable(slot.entry.name, _reason(slot.error))
            limit = slot.entry.max_queue or self.settings.max_queue
            if len(slot.waiting) + slot.inflight >= limit:
                raise QueueFull(limit)
            slot.counters.requests += 1
            slot.last_used = time.monotonic()
            direct = slot.state == "loaded" and not slot.held and not slot.swapping and not slot.waiting
            if direct:
                slot.inflight += 1
            else:
                slot.waiting.append(waiting)
                job.emit("loading" if slot.state in ("unloaded", "offloaded", "loading") else "queued",
                         eta_s=self._eta(slot), message=self._wait_message(slot))
                self._cond.notify_all()
        if direct:
            self._hand_over(slot, waiting, raise_errors=True)
        return job

    def generate(self, model: str, prompt: str | Mapping[str, Any], *, timeout: float | None = None,
                 **kwargs: Any) -> list[Output]:
        """Submit to ``model`` and wait: ``pool.generate("video", "a cat", seed=0)`` -> outputs (the keywords
        of :meth:`Engine.generate`)."""
        from ..engine.api import make_request

        return self.submit(make_request(prompt, **kwargs), model=model).result(timeout)

    def _with_defaults(self, slot: _Slot, request: GenerationRequest) -> GenerationRequest:
        """The entry's deployment defaults fill what the request left unset."""
        defaults = dict(slot.entry.defaults)
        if not defaults:
            return request
        negative = defaults.pop("negative_prompt", None)
        fill = {k: v for k, v in defaults.items() if getattr(request.params, k) is None}
        params = attrs.evolve(request.params, **fill) if fill else request.params
        return request.evolve(params=params, negative_prompt=request.negative_prompt
                              if request.negative_prompt is not None else negative)

    def _hand_over(self, slot: _Slot, w: _Waiting, *, raise_errors: bool) -> None:
        """Submit a waiting job to its model's engine (``slot.inflight`` already counts it) and relay its events."""
        ready = threading.Event()
        box: dict[str, Any] = {}
        outer = w.job

        def relay(ev: ProgressEvent) -> None:
            if not ev.terminal:
                if ev.phase in _RUNNING_PHASES and outer.status == "queued":
                    outer.mark_running()
                outer.emit(ev.phase, step=ev.step, total_steps=ev.total_steps, eta_s=ev.eta_s, message=ev.message)
                return
            ready.wait(30)  # the engine may end a job before its submit() returned to us
            inner = box.get("inner")
            self._finish_relay(slot, outer, inner)

        engine = slot.engine
        assert engine is not None
        try:
            inner = engine.submit(w.request, on_event=relay, limits=w.limits)
        except BaseException as exc:
            with self._cond:
                slot.inflight -= 1
                self._cond.notify_all()
            outer.finish("failed", error=exc)
            if raise_errors:
                raise
            return
        outer.request = inner.request
        outer.pool_inner = inner  # type: ignore[attr-defined]
        box["inner"] = inner
        ready.set()
        if outer.cancel_requested:
            inner.cancel()

    def _finish_relay(self, slot: _Slot, outer: Job, inner: Job | None) -> None:
        if inner is not None:
            outer.metrics.update(inner.metrics)
            outer.request = inner.request
            if inner.started_at is not None and outer.started_at is None:
                outer.started_at = inner.started_at
        with self._cond:
            slot.inflight -= 1
            slot.last_used = time.monotonic()
            self._cond.notify_all()
        status = inner.status if inner is not None and inner.done else "failed"
        error = inner.error if inner is not None else RuntimeError("the engine lost the job")
        outer.finish(status, outputs=inner.outputs if inner is not None else [], error=error)

    def _cancel(self, job: Job) -> None:
        with self._cond:
            found = False
            for slot in self._slots.values():
                for w in slot.waiting:
                    if w.job is job:
                        slot.waiting.remove(w)
                        found = True
                        break
                if found:
                    self._cond.notify_all()
                    break
        if found:
            job.finish("cancelled")
            return
        inner = getattr(job, "pool_inner", None)
        if inner is not None:
            inner.cancel()

    # ------------------------------------------------------------------ control thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    action = self._next_action()
                    if action is not None:
                        break
                    self._cond.wait(TICK_S)
            try:
                action()
            except BaseException:  # the control thread must not die
                logger.exception("model pool: an action failed")

    def _used(self) -> int:
        return sum(s.size for s in self._slots.values() if s.state in ("loaded", "loading"))

    def _next_action(self) -> Action | None:
        """The next thing to do (under the lock), or ``None`` to wait. Recomputes which models are held."""
        for slot in self._slots.values():
            slot.held = False
        used = self._used()
        target = None
        if not any(s.state == "loading" for s in self._slots.values()):  # one load at a time on the device
            waiting = [s for s in self._slots.values() if s.waiting and s.state in ("unloaded", "offloaded", "loaded")]
            first = min(waiting, key=lambda s: s.waiting[0].since) if waiting else None  # the turn rule
            if first is not None and first.state != "loaded":  # the oldest request's model is out: bring it in
                target = first
                self._hold_for(target, used)
        for slot in self._slots.values():  # loaded models take their waiting work unless held for room
            if slot.state == "loaded" and slot.waiting and not slot.held and not slot.swapping:
                return self._forward_action(slot)
        if target is not None:
            return self._make_room(target, used)
        if used > self.memory_budget:  # a load measured more than estimated: offload idle models to fit
            idle = self._victims(None, idle=True)
            if idle:
                return self._evict_action(idle[0])
        return self._host_budget_action()

    def _victims(self, target: _Slot | None, *, idle: bool) -> list[_Slot]:
        """Loaded swappable models other than ``target``, idle ones (nothing in their engine) or busy ones, in
        eviction order: without waiting work first, then lowest priority, then least recently used."""
        found = [s for s in self._slots.values() if s.state == "loaded" and s.swappable and s is not target
                 and not s.swapping and ((s.inflight == 0) == idle)]
        found.sort(key=lambda s: (bool(s.waiting), s.entry.priority, s.last_used))
        return found

    def _hold_for(self, target: _Slot, used: int) -> None:
        """Hold the models that must make room for ``target`` (idle ones first, then busy ones, each in eviction
        order): their new requests wait in the pool for their next turn, and a held busy model is offloaded once
        the work its engine admitted has finished."""
        budget = self.memory_budget
        free = used
        for victim in (*self._victims(target, idle=True), *self._victims(target, idle=False)):
            if free + target.size <= budget:
                return
            victim.held = True
            free -= victim.size

    def _make_room(self, target: _Slot, used: int) -> Action | None:
        """Load ``target`` if it fits; else offload one idle model; else wait for held ones (or refuse)."""
        budget = self.memory_budget
        if used + target.size <= budget:
            target.state = "loading"
            target.load_started = time.monotonic()
            return lambda: self._load(target)
        swappable = sum(s.size for s in self._slots.values() if s.state == "loaded" and s.swappable
                        and s is not target)
        if used - swappable + target.size > budget:
            if not any(s.swapping for s in self._slots.values()):
                return lambda: self._refuse(target, used - swappable)
            return None
        idle = self._victims(target, idle=True)
        if idle:
            return self._evict_action(idle[0])
        return None

    def _evict_action(self, victim: _Slot) -> Action:
        victim.swapping = True
        return lambda: self._offload(victim)

    def _forward_action(self, slot: _Slot) -> Action:
        batch = list(slot.waiting)
        slot.waiting.clear()
        slot.inflight += len(batch)

        def forward() -> None:
            for w in batch:
                if isinstance(w.job, _NoJob) or w.job.done:  # a load() marker, or cancelled meanwhile
                    with self._cond:
                        slot.inflight -= 1
                    continue
                self._hand_over(slot, w, raise_errors=False)
        return forward

    def _host_over(self) -> bool:
        """Offloaded models hold more host memory than ``host_memory_budget`` (under the lock)."""
        if self.host_memory_budget is None:
            return False
        offloaded = [s for s in self._slots.values() if s.state == "offloaded" and not s.swapping]
        return bool(offloaded) and sum(s.swap.nbytes for s in offloaded if s.swap is not None) \
            > self.host_memory_budget

    def _host_budget_action(self) -> Action | None:
        if not self._host_over():
            return None
        offloaded = [s for s in self._slots.values() if s.state == "offloaded" and not s.swapping]
        victim = min(offloaded, key=lambda s: (s.entry.priority, s.last_used))
        victim.swapping = True
        return lambda: self._unload(victim)

    # ------------------------------------------------------------------ actions (control thread, outside the lock)
    def _load(self, slot: _Slot) -> None:
        restoring = slot.engine is not None and slot.swap is not None
        name = slot.entry.name
        t0 = time.perf_counter()
        try:
            if restoring:
                assert slot.swap is not None
                slot.swap.restore()
                slot.swap = None
            else:
                self._build(slot)
            assert slot.engine is not None
            size = resident_bytes(slot.engine.pipeline, self.device)
        except BaseException as exc:
            logger.error("model %s failed to load: %s: %s", name, type(exc).__name__, exc)
            self._failed(slot, exc)
            return
        seconds = time.perf_counter() - t0
        with self._cond:
            if not restoring and size != slot.size:
                logger.info("model %s: %s resident (estimated %s from its weight files)", name, format_bytes(size),
                            format_bytes(slot.size))
            slot.size, slot.measured = size, True
            slot.state = "loaded"
            slot.last_load_s = seconds
            slot.load_started = None
            c = slot.counters
            if restoring:
                c.restores += 1
                c.restore_seconds += seconds
            else:
                c.loads += 1
                c.load_seconds += seconds
            self.order.append(("restore" if restoring else "load", name))
            self._cond.notify_all()
        logger.info("model %s %s in %.2f s", name, "restored" if restoring else "loaded", seconds)

    def _build(self, slot: _Slot) -> None:
        from ..engine.api import Engine

        entry = slot.entry
        changes = {k: getattr(entry, k) for k in ("max_queue", "max_num_seqs") if getattr(entry, k) is not None}
        settings = self.settings.evolve(**changes) if changes else self.settings
        slot.engine = Engine(slot.path if slot.path and not entry.checkpoint.lower().startswith("tiny:")
                             else entry.checkpoint, host=self.host, settings=settings, platform=self.platform,
                             **entry.engine_kwargs())

    def _failed(self, slot: _Slot, exc: BaseException) -> None:
        with self._cond:
            slot.state, slot.error = "failed", exc
            slot.load_started = None
            slot.counters.load_failures += 1
            dropped = list(slot.waiting)
            slot.waiting.clear()
            self.order.append(("failed", slot.entry.name))
            self._cond.notify_all()
        error = ModelUnavailable(slot.entry.name, _reason(exc))
        for w in dropped:
            w.job.finish("failed", error=error)
        if slot.engine is not None:
            slot.engine.close(cancel_running=True, timeout=5)
            slot.engine = None

    def _refuse(self, slot: _Slot, fixed: int) -> None:
        """The model cannot fit even with every swappable model out: its waiting requests fail (it stays
        unloaded and later requests are tried again, since pinned models may be fewer by then)."""
        reason = (f"it needs about {format_bytes(slot.size)} and the pinned or loading models hold "
                  f"{format_bytes(fixed)} of the {format_bytes(self.memory_budget)} budget")
        with self._cond:
            dropped = list(slot.waiting)
            slot.waiting.clear()
            self.order.append(("refused", slot.entry.name))
        for w in dropped:
            w.job.finish("failed", error=ModelUnavailable(slot.entry.name, reason))

    def _offload(self, slot: _Slot) -> None:
        t0 = time.perf_counter()
        try:
            assert slot.engine is not None
            slot.swap = HostSwap(slot.engine.pipeline, self.device)
            self.platform.empty_cache()
        except BaseException as exc:
            logger.error("offloading model %s failed (%s: %s); unloading it", slot.entry.name, type(exc).__name__, exc)
            with self._cond:
                slot.swap = None
            self._unload(slot)
            return
        seconds = time.perf_counter() - t0
        with self._cond:
            slot.state, slot.swapping = "offloaded", False
            slot.counters.offloads += 1
            slot.counters.offload_seconds += seconds
            self.order.append(("offload", slot.entry.name))
            self._cond.notify_all()
        logger.info("model %s offloaded to host memory in %.2f s", slot.entry.name, seconds)

    def _unload(self, slot: _Slot) -> None:
        t0 = time.perf_counter()
        engine = slot.engine
        if engine is not None:
            engine.close(cancel_running=False, timeout=30)
        with self._cond:
            slot.engine, slot.swap = None, None
        del engine
        gc.collect()
        self.platform.empty_cache()
        seconds = time.perf_counter() - t0
        with self._cond:
            slot.state, slot.swapping = "unloaded", False
            slot.counters.unloads += 1
            slot.counters.unload_seconds += seconds
            self.order.append(("unload", slot.entry.name))
            self._cond.notify_all()

    def _preload(self) -> None:
        """Pinned models first (each must load and fit), then the others by priority and order while they fit."""
        slots = sorted(self._slots.values(), key=lambda s: (s.swappable, -s.entry.priority))
        for slot in slots:
            if self._used() + slot.size > self.memory_budget:
                continue
            slot.state = "loading"
            self._load(slot)
            if slot.state == "failed" and not slot.swappable:
                self.close()
                raise ModelUnavailable(slot.entry.name, f"a pinned model must load at start-up: {_reason(slot.error)}")

    # ------------------------------------------------------------------ progress while waiting
    def _eta(self, slot: _Slot) -> float | None:
        """Seconds until ``slot``'s model serves: its own last load (or restore) time, else, for a model this pool
        never loaded, its estimated bytes at the speed the pool's other first loads went; less the time spent."""
        expected = slot.last_load_s if slot.last_load_s is not None else self._first_load_estimate(slot)
        if expected is None:
            return None
        started = slot.load_started
        return max(0.0, expected - (time.monotonic() - started)) if started is not None else expected

    def _first_load_estimate(self, slot: _Slot) -> float | None:
        loaded = [s for s in self._slots.values() if s is not slot and s.counters.loads and s.measured]
        seconds = sum(s.counters.load_seconds for s in loaded)
        if seconds <= 0 or slot.size <= 0:
            return None
        per_second = sum(s.size * s.counters.loads for s in loaded) / seconds
        return slot.size / per_second if per_second > 0 else None

    def _wait_message(self, slot: _Slot) -> str:
        if slot.state == "loading":
            return f"loading model {slot.entry.name}"
        if slot.state in ("unloaded", "offloaded"):
            return f"waiting for model {slot.entry.name} ({slot.state}) to be loaded"
        return f"waiting while model {slot.entry.name} makes room for another model"

    def _tick_loop(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                due = [(w.job, "loading" if s.state in ("unloaded", "offloaded", "loading") else "queued",
                        self._eta(s), self._wait_message(s)) for s in self._slots.values() for w in s.waiting]
            for job, phase, eta, message in due:
                job.emit(phase, eta_s=eta, message=message)
            time.sleep(TICK_S)

    # ------------------------------------------------------------------ status and control
    def status(self) -> dict[str, ModelStatus]:
        """Every model's state, sizes, queue and counters (a snapshot)."""
        out = {}
        with self._cond:
            slots = [(s, s.state, len(s.waiting), s.engine) for s in self._slots.values()]
        for s, state, waiting, engine in slots:
            stats = engine.stats() if engine is not None else {}
            resident = resident_bytes(engine.pipeline, self.device) if engine is not None and state == "loaded" else 0
            out[s.entry.name] = ModelStatus(
                name=s.entry.name, state=state, resident_bytes=resident, size_bytes=s.size, size_measured=s.measured,
                pinned=not s.swappable, priority=s.entry.priority, queued=waiting + int(stats.get("queued", 0)),
                running=int(stats.get("running", 0)), error=_reason(s.error) if s.error is not None else None,
                counters=attrs.evolve(s.counters))
        return out

    def state_of(self, model: str) -> str:
        return self._slot(model).state

    def stats(self) -> dict[str, Any]:
        """The engines' counters summed (what a one-model server reports), plus ``models``: per-model status."""
        total: dict[str, Any] = {"queued": 0, "queued_outputs": 0, "running": 0, "steps_executed": 0,
                                 "batches_executed": 0, "jobs_succeeded": 0, "jobs_failed": 0, "jobs_cancelled": 0}
        with self._cond:
            engines = [s.engine for s in self._slots.values() if s.engine is not None]
            waiting = sum(len(s.waiting) for s in self._slots.values())
        for engine in engines:
            for key, value in engine.stats().items():
                if key in total and isinstance(value, int) and not isinstance(value, bool):
                    total[key] += value
        total["queued"] += waiting
        total["closed"] = self._closed
        return total

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no model has waiting or running work and no load is in progress (tests, benchmarks)."""
        end = time.monotonic() + timeout
        with self._cond:
            while any(s.waiting or s.inflight or s.state == "loading" or s.swapping for s in self._slots.values()) \
                    or self._host_over():
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, TICK_S))
        return True

    def load(self, model: str, timeout: float = 600.0) -> None:
        """Bring ``model`` in now (making room by the same policy) and wait until it is ``loaded``."""
        from ..engine.request import GenerationRequest

        slot = self._slot(model)
        nobody = _NoJob()
        marker = _Waiting(cast("Job", nobody), GenerationRequest(prompt="(load)"), None, time.monotonic())
        with self._cond:
            if slot.state == "loaded":
                return
            slot.waiting.appendleft(marker)
            self._cond.notify_all()
            end = time.monotonic() + timeout
            while slot.state not in ("loaded", "failed"):
                if nobody.error is not None:  # refused: it cannot fit the budget
                    raise nobody.error
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"model {model!r} did not load within {timeout} s")
                self._cond.wait(min(left, TICK_S))
            if marker in slot.waiting:
                slot.waiting.remove(marker)
        if slot.state == "failed":
            raise ModelUnavailable(slot.entry.name, _reason(slot.error))

    @property
    def worker_alive(self) -> bool:
        """Whether the control thread and every engine's worker run (the server's liveness check)."""
        engines = [s.engine for s in self._slots.values() if s.engine is not None]
        return self._control.is_alive() and all(e.worker_alive for e in engines)

    @property
    def worker_failure(self) -> str | None:
        for s in self._slots.values():
            if s.engine is not None and not s.engine.worker_alive:
                return f"model {s.entry.name}: " + (s.engine.worker_failure or "its engine worker stopped")
        return None if self._control.is_alive() else "the model pool's control thread stopped"

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, cancel_running: bool = False, timeout: float | None = None) -> bool:
        """Stop admitting; waiting jobs are cancelled with ``cancel_running``, else they are failed with
        ``EngineClosed`` (no model will be loaded for them); then every engine closes. Idempotent."""
        with self._cond:
            self._closed = True
            dropped = [w for s in self._slots.values() for w in s.waiting]
            for s in self._slots.values():
                s.waiting.clear()
            engines = [s.engine for s in self._slots.values() if s.engine is not None]
            self._cond.notify_all()
        for w in dropped:
            if cancel_running:
                w.job.finish("cancelled")
            else:
                w.job.finish("failed", error=EngineClosed("the model pool closed before the model was loaded"))
        stopped = True
        for engine in engines:
            stopped = engine.close(cancel_running=cancel_running, timeout=timeout) and stopped
        return stopped

    def __enter__(self) -> ModelPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel_running=exc[0] is not None)

    def __repr__(self) -> str:
        states = ", ".join(f"{s.entry.name}={s.state}" for s in self._slots.values())
        return f"ModelPool({states}; budget {format_bytes(self.memory_budget)})"


class _NoJob:
    """The waiting-list marker :meth:`ModelPool.load` uses: a job nobody listens to, except for the error the pool
    fails its waiting work with (a model that cannot fit the budget), which :meth:`ModelPool.load` raises."""

    done = False

    def __init__(self) -> None:
        self.error: BaseException | None = None

    def emit(self, *args: object, **kwargs: object) -> None:
        return None

    def finish(self, *args: object, error: BaseException | None = None, **kwargs: object) -> bool:
        if error is not None:
            self.error = error
        return False


def _reason(exc: BaseException | None) -> str:
    if exc is None:
        return "unknown error"
    if isinstance(exc, ModelUnavailable):
        return exc.reason
    return f"{type(exc).__name__}: {exc}"


def served_names(pool: ModelPool) -> dict[str, tuple[str, ...]]:
    """``{model: every name it answers to}`` for the pool's models."""
    return {m: pool.names_of(m) for m in pool.models}


__all__: Sequence[str] = ("STATES", "ModelCounters", "ModelPool", "ModelStatus", "served_names")
