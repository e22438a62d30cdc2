"""The public engine: :class:`Engine` (sync, one background worker thread) and :class:`AsyncEngine`.

``submit`` validates, runs the ``omnicore_preprocess`` hook once in the caller's thread (outside the engine
lock) and queues exactly what it returned. The worker forms batches through the :class:`Scheduler`
(admission wait, batch keys, quality) and runs them with the :class:`BatchRunner`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from ..config import Settings
from ..errors import EngineClosed, InvalidRequest, PluginError, UnsupportedFeature
from ..lora.errors import LoRAError
from ..lora.records import LoRA
from ..lora.registry import AdapterRegistry
from ..lora.runtime import LoRARuntime
from ..offload.policy import OFFLOAD_MODES, apply_offload
from ..parallel.config import ParallelConfig
from ..parallel.launch import start_group
from ..platforms.host_memory import HostMemory, reset_peak_rss
from ..regional_compile import RegionalCompile, apply_regional_compile, check_compile, normalize_compile, outside_graph
from .inputs import CheckedRequest, check_request
from .jobs import Job, Listener
from .limits import WorkLimits, check_limits
from .loading import ResolvedModel, instantiate_platform, load_options, load_pipeline, resolve_load
from .progress import TERMINAL_PHASES, ProgressEvent
from .request import GenerationRequest, MediaInput, SamplingParams
from .runner import BatchRunner, EngineStats
from .scheduler import Scheduler, admission_wait

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..offload.layerwise import LayerwiseOffload
    from ..offload.model import ModelOffload
    from ..outputs.output import Output
    from ..planning.admission import MemoryGuard
    from ..platforms.base import Platform
    from ..plugin_host.host import PluginHost
    from ..quantization import QuantReport
    from ..specs import AttentionRequirement, CacheMethodSpec, ModelSpec
    from .step_checkpoint import CheckpointPlan

logger = logging.getLogger("omnicore.engine")

_SAMPLING_FIELDS = frozenset(a.name for a in attrs.fields(SamplingParams))
CacheMethodArg = str | tuple[str, Any]


_instantiate_platform = instantiate_platform  # the name callers used before it moved to .loading


def _check_forced_attention(spec: ModelSpec, forced: str | None, loaded: bool = False) -> None:
    """A forced attention backend must reach the model: refuse it for a model that declares it picks its own.
    ``loaded``: ``spec`` is the loaded pipeline's (a generic adapter narrows it per checkpoint, and says which
    pipeline it serves in its description)."""
    if forced and not spec.capabilities.honours_attention_backend:
        what = f"model {spec.name!r} ({spec.description})" if loaded else f"model {spec.name!r}"
        raise UnsupportedFeature("attention_backend", f"{what} does not run its attention through "
                                 f"omnicore's backend selection, so --attention-backend / OMNICORE_ATTENTION_BACKEND="
                                 f"{forced!r} cannot apply to it; unset it")


def _warn_if_forced_attention_unused(spec: ModelSpec, forced: str | None, requests: int) -> None:
    """A model that says it honours the backend but asked for none while loading probably ignores it."""
    if forced and requests == 0:
        logger.warning("attention backend %r is forced, but model %s asked for no attention backend while loading; "
                       "it may ignore it (a model that picks its own declares honours_attention_backend=False)",
                       forced, spec.name)


class Engine:
    """Loads a model and serves requests on one background worker thread.

    :param model: ``tiny:<preset>``, a local checkpoint directory, or a Hugging Face repo id.
    :param host: plugin host (default: the process-wide one, with installed plugins).
    :param settings: engine settings (default: the host's).
    :param platform: a platform name or instance (default: the host's selection).
    :param cache_methods: cache method names, or ``(name, config)`` pairs, enabled after loading.
    :param offload: ``"none"``, ``"model"`` or ``"layerwise"``: told to the pipeline's loader, then applied to
        what the pipeline declares (see :mod:`omnicore.offload.policy`).
    :param model_options: the model's declared deployment options (``omnicore models`` lists them); unknown
        names and bad values are a ``ConfigError`` before loading; undeclared ones get their defaults.
    :param vae_decode_precision: ``"fp32"``, ``"fp16"``, ``"bf16"`` or ``None`` (the model's choice).
    :param parallel: ``"cfg=2,ulysses=2"`` (or a :class:`~omnicore.parallel.ParallelConfig`): run over that many
        worker processes on ``torch.distributed`` (see :mod:`omnicore.parallel`); this process is rank 0. Under
        ``torchrun`` the other ranks serve the group from inside ``Engine(...)`` and exit when it closes. Workers
        are spawned, so they import the caller's main module: scripts guard it with ``if __name__ == "__main__"``.
    :param quantization: ``"int8"`` or ``"fp8"``: weight-only per-output-channel quantization of the linears the
        model declares (its DiT blocks and text encoder; see :mod:`omnicore.quantization`), after loading; under
        ``parallel`` each rank quantizes what it holds (a tensor-parallel rank its own shard).
    :param lora_registry: where requests' ``loras`` are resolved, read and cached (see
        :class:`~omnicore.lora.AdapterRegistry`: preloaded names, the only directories paths may name, the device
        LRU budget); its preloaded adapters are checked against the model here. Default: an empty registry, which
        refuses every adapter. Adapters run unmerged per row of a mixed batch (:mod:`omnicore.lora.runtime`), on
        every rank of a ``parallel`` group (sharded like their linears under ``tp``); refused with ``compile``.
    :param compile: ``True``/``"blocks"``: regional ``torch.compile`` of the model's repeated blocks (one compiled
        graph per block class, see :mod:`omnicore.regional_compile`); ``"blocks-cudagraphs"`` adds CUDA graphs (cuda
        platform only). Refused with offload and ``parallel``, before anything loads.
    :param warmup: run one short generation at the model's default request before returning, so one-time costs
        (compilation above all) are paid at start-up, not by the first request (see :mod:`omnicore.engine.warmup`).
    :param device_memory: per-rank memory limit in GiB: each request's estimated peak (the placement's weights +
        its activations and caches, :mod:`omnicore.planning.admission`) is checked at ``submit`` and a request over
        it is a ``MemoryLimitExceeded`` before it runs. Default ``None``: a CUDA device's total memory, no check on
        other platforms; ``0`` turns the check off.

    ``close()`` (or leaving a ``with`` block) stops admission; see :meth:`close` for running work.
    """

    def __init__(self, model: str | os.PathLike[str], *, host: PluginHost | None = None,
                 settings: Settings | None = None, platform: str | Platform | None = None,
                 cache_methods: Iterable[CacheMethodArg] = (), offload: str = "none",
                 model_options: Mapping[str, Any] | None = None, vae_decode_precision: str | None = None,
                 parallel: str | Mapping[str, int] | ParallelConfig | None = None, compile: bool | str = False,
                 quantization: str | None = None,
                 lora_registry: AdapterRegistry | None = None,
                 warmup: bool = False, device_memory: float | None = None) -> None:
        from ..quantization import check_mode

        self.quantization = check_mode(quantization)  # a bad mode fails before anything loads
        if host is None:
            from ..plugin_host.host import default_host

            host = default_host()
        self.host = host
        self.settings = settings if settings is not None else host.settings
        if offload not in OFFLOAD_MODES:
            raise InvalidRequest("offload", f"must be one of {list(OFFLOAD_MODES)}, got {offload!r}")
        self.parallel = ParallelConfig.parse(parallel)  # a malformed layout fails before anything loads
        if self.quantization is not None and self.parallel.enabled and offload != "none":
            raise InvalidRequest("quantization", "not supported with --parallel and --offload together; drop one")
        self.compile_mode = normalize_compile(compile)
        if self.compile_mode != "none" and lora_registry is not None and (lora_registry.modules
                                                                         or lora_registry.lora_dirs):
            raise UnsupportedFeature("compile", f"--compile {self.compile_mode} cannot be combined with LoRA adapters "
                                     "(--lora, --lora-modules, --lora-dir): their hooks run inside the compiled "
                                     "blocks and change per batch; serve adapters without --compile")
        methods = [(m, None) if isinstance(m, str) else (m[0], m[1]) for m in cache_methods]
        host.check_cache_methods([m for m, _ in methods])  # unknown / conflicting names fail before any work
        method_specs: list[CacheMethodSpec] = []

        def refuse(platform: Platform, resolved: ResolvedModel) -> None:  # what the spec rules out, before loading
            if resolved.spec.provider:
                host.require_loaded(resolved.spec.provider)
            method_specs.extend(host.check_cache_methods([m for m, _ in methods], resolved.spec))
            host.check_model_platform(resolved.spec, platform.name)  # before any weight is read
            check_compile(self.compile_mode, model=resolved.spec.name, platform=platform.name, offload=offload,
                          parallel=self.parallel.enabled)
            _check_forced_attention(resolved.spec, self.settings.attention_backend or host.settings.attention_backend)

        target = resolve_load(host, model, self.settings, platform=platform, model_options=model_options,
                              check=refuse)
        self.platform: Platform = target.platform
        self.resolved: ResolvedModel = target.resolved
        self.model_options = dict(target.model_options)
        self.memory_guard = self._memory_guard(device_memory, offload, [m for m, _ in methods])
        options = load_options(target, attention=self._attention, offload=offload,
                               vae_decode_precision=vae_decode_precision)
        self._attention_requests = 0
        self.group = start_group(self.parallel, self.resolved.spec, os.fspath(model), self.platform, self.settings,
                                 offload=offload, model_options=self.model_options,
                                 vae_decode_precision=vae_decode_precision, cache_methods=methods,
                                 quantization=self.quantization,
                                 lora_budgets=(None, None) if lora_registry is None else
                                 (lora_registry.max_device_bytes, lora_registry.max_host_bytes))
        options.parallel = self.group.ctx if self.group is not None else None
        reset_peak_rss()  # this process's host peak from here on is the load's (see load_memory)
        try:
            self.pipeline = load_pipeline(self.resolved, options, host)
            _check_forced_attention(self.pipeline.spec, self.settings.attention_backend
                                    or host.settings.attention_backend, loaded=True)  # the spec as loaded
        except BaseException as exc:
            if self.group is not None:
                self.group.finish_load(exc)  # ends the workers, then raises exc
            raise
        #: host memory per rank (index = rank) at the end of its load: ``peak_rss_bytes`` is the load's peak RSS
        #: on rank 0 and a worker's whole startup peak (spawn, imports, load); None where ``/proc`` is missing
        self.load_memory: list[HostMemory | None] = [HostMemory.now()]
        if self.group is not None:
            self.group.finish_load(None, self.load_memory[0])  # every rank loaded, or the group ends and this raises
            self.load_memory = list(self.group.load_memory)
        _warn_if_forced_attention_unused(self.resolved.spec, self.settings.attention_backend
                                         or host.settings.attention_backend, self._attention_requests)
        self.quantization_report: dict[str, QuantReport] = {}
        if self.quantization is not None:  # before offload and caches, which then move the quantized weights
            from ..quantization import apply_to_pipeline

            self.quantization_report = apply_to_pipeline(self.pipeline, self.resolved.spec, self.quantization,
                                                         root=self.resolved.path)  # or its quantized/<mode>/
        self.offload_handles: list[LayerwiseOffload | ModelOffload] = []
        self.cache_handles: list[Any] = []
        self.compile_handle: RegionalCompile | None = None
        try:
            resident = [m for s in method_specs for m in s.resident_modules(self.pipeline)]  # the caches' weights
            self.offload_handles = apply_offload(self.pipeline, offload, self.platform.device(), resident=resident)
            for spec, (_, cfg) in zip(method_specs, methods):
                self.cache_handles.append(host.enable_cache(self.pipeline, spec, cfg))
            self.lora_registry = lora_registry if lora_registry is not None else AdapterRegistry()
            self.lora = self._lora_runtime([s.name for s in method_specs])
            if self.compile_mode != "none":  # last: caches and hooks are in place around the compiled blocks
                self.compile_handle = apply_regional_compile(self.pipeline, self.compile_mode,
                                                             log_recompiles=logger.isEnabledFor(logging.INFO))
        except BaseException:  # leave the host's hooks and the weights as they were
            self._remove_handles()
            if self.group is not None:
                self.group.shutdown()
            raise
        caps = self.spec.capabilities
        self.scheduler: Scheduler[Job] = Scheduler(
            max_num_seqs=self.settings.max_num_seqs, max_queue=self.settings.max_queue,
            request_batch_max_wait_ms=self.settings.request_batch_max_wait_ms,
            supports_batching=caps.supports_batching)
        self._stats = EngineStats()
        self._runner = BatchRunner(host, self.pipeline, self.platform, self._stats, group=self.group, lora=self.lora)
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        self._running: list[Job] = []
        self._worker = threading.Thread(target=self._loop, name=f"omnicore-engine-{self.spec.name}", daemon=True)
        self._worker.start()
        self.warmup_s: float | None = None
        if warmup:
            self._warm_up()

    def _memory_guard(self, device_memory: float | None, offload: str, caches: list[str]) -> MemoryGuard | None:
        """The per-request memory check (None: off), priced before loading; a placement whose weights alone
        exceed the limit is refused here."""
        from ..planning.admission import build_guard

        guard = build_guard(self.resolved.spec, self.resolved.path, platform=self.platform,
                            dtype=self.platform.default_dtype(), device_memory_gib=device_memory,
                            parallel=self.parallel, offload=offload, quantization=self.quantization,
                            caches=tuple(caches), model_options=self.model_options)
        if guard is not None:
            guard.check_resident()
        return guard

    def _lora_runtime(self, cache_methods: list[str]) -> LoRARuntime | None:
        """The model's LoRA runtime (None for a model that declares no targets), with what this deployment rules
        out; the registry's preloaded adapters are read and checked now, so a bad one fails at start-up."""
        if self.spec.lora is None:
            check_loras = getattr(self.pipeline, "check_loras", None)  # a pipeline applying adapters its own way
            if callable(check_loras):
                check_loras([LoRA(name) for name in self.lora_registry.list_modules()], self.lora_registry)
            elif self.lora_registry.list_modules():
                raise InvalidRequest("lora_modules", f"model {self.spec.name!r} does not support LoRA adapters")
            return None
        runtime = LoRARuntime(self.lora_registry, self.spec, self.pipeline, self.platform.ops)
        if self.compile_mode != "none":
            runtime.refusal = ("LoRA is not supported with --compile yet (the adapters' hooks run inside the compiled "
                               "blocks and change per batch); serve adapters without --compile")
        runtime.adaln_cache = "adaln_schedule" in cache_methods
        self.lora_registry.preload(runtime.target_map)
        return runtime

    def _warm_up(self) -> None:
        """One default request, 1 step, through the normal queue (the engine is otherwise idle at this point)."""
        from .loading import find_preset
        from .warmup import warmup_request

        modes = None
        if self.resolved.preset is not None:
            name = self.resolved.preset
            modes = find_preset(self.host, name if name.startswith("tiny:") else f"tiny:{name}")[1].modes
        start = time.perf_counter()
        try:
            self.submit(warmup_request(self.spec, modes)).result()
        except BaseException:
            self.close(cancel_running=True)
            raise
        self.warmup_s = time.perf_counter() - start
        logger.info("warm-up of %s took %.1f s", self.spec.name, self.warmup_s)

    # ------------------------------------------------------------------ properties
    @property
    def spec(self) -> ModelSpec:
        return self.pipeline.spec

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def worker_alive(self) -> bool:
        """Whether the worker thread runs (the server reports ``unhealthy`` and fails jobs when it died)."""
        return self._worker.is_alive() and (self.group is None or self.group.healthy)

    @property
    def worker_failure(self) -> str | None:
        """Why the parallel worker group broke (e.g. ``worker rank 1 (pid ...) exited with code -9``), else None."""
        return self.group.failure if self.group is not None else None

    def _attention(self, requirement: AttentionRequirement) -> Callable[..., Any]:
        self._attention_requests += 1
        impl = self.host.select_attention(requirement).load_impl()
        return impl if self.compile_mode == "none" else outside_graph(impl)

    # ------------------------------------------------------------------ admission
    def submit(self, request: GenerationRequest | CheckedRequest, *, on_event: Listener | None = None,
               limits: WorkLimits | None = None, checkpoint: CheckpointPlan | None = None) -> Job:
        """Preprocess ``request`` (here, once) and queue it. Raises ``InvalidRequest``, ``QueueFull``,
        ``EngineClosed``; a request without a seed gets a random one first (recorded in the outputs).

        The resolved request is checked against the model's declared limits and the caller's ``limits``
        (e.g. the server's budget) before it is queued (:class:`~.limits.LimitExceeded`). A
        :class:`~.inputs.CheckedRequest` for this engine's spec (the CLI checked it before loading) is not
        checked against the spec again. ``checkpoint`` asks for step checkpoints of this job and/or a resume from one
        (:mod:`.step_checkpoint`); a job that resumes runs in a batch of its own."""
        checked = isinstance(request, CheckedRequest) and request.spec == self.spec
        if isinstance(request, CheckedRequest):
            request = request.request
        if not isinstance(request, GenerationRequest):
            raise InvalidRequest("request", f"must be a GenerationRequest, got {type(request).__name__}")
        if self._closed:
            raise EngineClosed("engine is closed")
        if not checked:
            request = check_request(request, self.spec)  # roles, kinds, counts, outputs: before any model code
        if request.loras:  # read and checked against the model before anything is queued (LoRAError -> 400)
            if self.lora is not None:
                self.lora.check(request.loras)
            elif callable(check_loras := getattr(self.pipeline, "check_loras", None)):
                check_loras(request.loras, self.lora_registry)
            else:
                raise LoRAError(request.loras[0].name_or_path, None,
                                f"model {self.spec.name!r} does not support LoRA adapters")
        request = request.seeded(self.spec.defaults.seed)
        job = Job(request, canceller=self._cancel)
        job.checkpoint = checkpoint
        if on_event is not None:
            job.add_listener(on_event)
        job.emit("preprocess")
        t = time.perf_counter()
        try:
            prepared = self.host.preprocess(request=request, pipeline=self.pipeline)
            if not isinstance(prepared, GenerationRequest):
                raise PluginError(self.spec.provider or self.spec.name,
                                  f"preprocess returned {type(prepared).__name__}, not a GenerationRequest")
            check_limits(prepared, WorkLimits.of_model(self.spec), limits)
            if self.memory_guard is not None:  # the placement's weights + this request's peak vs the limit
                self.memory_guard.check(request)
            key = self.pipeline.batch_key(prepared)
            if checkpoint is not None and checkpoint.resume is not None:
                key = ("resume", job.id, key)  # its rows' state comes from the snapshot: a batch of its own
        except BaseException as exc:
            err = _as_requested(exc, request)
            job.finish("failed", error=err)
            if err is exc:
                raise
            raise err from exc
        job.request = prepared
        job.metrics["preprocess_s"] = time.perf_counter() - t
        job.admitted_at = time.perf_counter()
        try:
            with self._cond:
                if self._closed:
                    raise EngineClosed("engine is closed")
                self.scheduler.add(job, key=key, size=prepared.params.num_outputs, quality=prepared.quality)
                self._cond.notify_all()
        except BaseException as exc:
            job.finish("failed", error=exc)
            raise
        job.emit("queued")
        return job

    def generate(self, prompt: str | Mapping[str, Any], *, images: Sequence[Any] = (), videos: Sequence[Any] = (),
                 audios: Sequence[Any] = (), inputs: Sequence[MediaInput] = (),
                 negative_prompt: str | None = None, modalities: Sequence[str] | None = None,
                 extra: Mapping[str, Any] | None = None, quality: str = "standard",
                 loras: Sequence[LoRA | str] = (), timeout: float | None = None,
                 **sampling_params: Any) -> list[Output]:
        """Submit and wait: ``engine.generate("a cat", height=512, seed=0)`` -> outputs.

        Conditioning media: ``inputs=[MediaInput("image", "first_frame", path), ...]`` with roles, or
        ``images=``/``videos=``/``audios=`` which take the model's default role for their kind. Adapters:
        ``loras=[LoRA("name-or-path", scale=0.8), ...]`` (resolved by the engine's ``lora_registry``)."""
        request = make_request(prompt, images=images, videos=videos, audios=audios, inputs=inputs,
                               negative_prompt=negative_prompt, modalities=modalities, extra=extra, quality=quality,
                               loras=loras, **sampling_params)
        return self.submit(request).result(timeout)

    def _cancel(self, job: Job) -> None:
        with self._cond:
            removed = self.scheduler.remove(job)
        if removed:
            job.finish("cancelled", on_finish=self._count_cancelled)

    def _count_cancelled(self) -> None:
        with self._stats.lock:
            self._stats.jobs_cancelled += 1

    # ------------------------------------------------------------------ worker
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not len(self.scheduler) and not self._closed:
                    self._cond.wait()
                if not len(self.scheduler):
                    return  # closed and drained
                decision = self.scheduler.get_admission_wait_decision(time.monotonic())
                if decision.should_wait:
                    waited = admission_wait(self.scheduler, self._cond, decision, time.monotonic,
                                            lambda: self._closed)
                    logger.debug("admission wait: %d waiting, max batch %d, waited %.1f ms",
                                 self.scheduler.waiting, decision.max_batch, waited * 1000)
                batch = self.scheduler.next_batch()
                self.scheduler.running = True
                self._running = batch
            now = time.perf_counter()
            started = []
            for job in batch:
                job.metrics["queue_s"] = now - (job.admitted_at if job.admitted_at is not None else now)
                if job.mark_running():
                    started.append(job)
            try:
                self._runner.run(started)
            except BaseException:  # the runner already failed the jobs; never let the worker die
                logger.exception("engine worker: unexpected error")
            finally:
                with self._cond:
                    self.scheduler.running = False
                    self._running = []
                    self._cond.notify_all()
            # drop the finished jobs before waiting: their requests hold decoded inputs (the server's decode budget)
            batch = started = []
            job = None  # type: ignore[assignment]  # (the loop variable would keep the last job alive)

    # ------------------------------------------------------------------ control
    def stats(self) -> dict[str, int | bool]:
        """Queue depth (requests and outputs), running jobs, and counters since start."""
        with self._cond:
            queued, queued_outputs, running = len(self.scheduler), self.scheduler.waiting, len(self._running)
        s = self._stats
        with s.lock:
            return {"queued": queued, "queued_outputs": queued_outputs, "running": running,
                    "steps_executed": s.steps_executed, "batches_executed": s.batches_executed,
                    "jobs_succeeded": s.jobs_succeeded, "jobs_failed": s.jobs_failed,
                    "jobs_cancelled": s.jobs_cancelled, "last_batch_size": s.last_batch_size,
                    "max_num_seqs": self.scheduler.max_num_seqs, "max_queue": self.scheduler.max_queue,
                    "closed": self._closed}

    def close(self, cancel_running: bool = False, timeout: float | None = None) -> bool:
        """Stop admitting. By default queued and running work still completes; with ``cancel_running``
        queued jobs are cancelled at once and running ones at their next step. Idempotent.

        Returns ``True`` when the worker has stopped (``False`` if ``timeout`` ran out first).
        """
        with self._cond:
            self._closed = True
            dropped = self.scheduler.drain() if cancel_running else []
            running = list(self._running) if cancel_running else []
            self._cond.notify_all()
        for job in dropped:
            job.cancel()
            job.finish("cancelled", on_finish=self._count_cancelled)
        for job in running:
            job.cancel()
        if threading.current_thread() is not self._worker:
            self._worker.join(timeout)
        stopped = not self._worker.is_alive()
        if stopped:  # cache methods leave the host's hooks with the engine that enabled them
            self._remove_handles()
            if self.group is not None:
                self.group.shutdown()  # every worker process ends (asked, then signalled)
        return stopped

    def _remove_handles(self) -> None:
        """Undo compilation, then cache methods (newest first, restoring weights they offloaded), then weight
        offload."""
        handles = [*reversed(self.cache_handles), *reversed(self.offload_handles)]
        lora = getattr(self, "lora", None)
        if lora is not None:  # the LoRA hooks come off first (the model is as loaded again)
            handles.insert(0, lora)
            self.lora = None
        if self.compile_handle is not None:
            handles.insert(0, self.compile_handle)
        self.cache_handles, self.offload_handles, self.compile_handle = [], [], None
        for handle in handles:
            remove = getattr(handle, "remove", None)
            if callable(remove):
                remove()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel_running=exc[0] is not None)

    def __repr__(self) -> str:
        return f"Engine({self.spec.name!r}, source={self.resolved.source}, closed={self._closed})"


def _as_requested(exc: BaseException, request: GenerationRequest) -> BaseException:
    """A sampling value the model's ``preprocess`` resolved out of range (LingBot rounds ``num_frames`` 100000 up
    to 100001 on its 4k+1 grid) is reported with the value the caller sent, not only the resolved one."""
    if not isinstance(exc, InvalidRequest) or not exc.field.startswith("params."):
        return exc
    asked = getattr(request.params, exc.field[len("params."):], None)
    got = re.search(r"got (-?\d+(?:\.\d+)?)$", exc.rule)
    if asked is None or isinstance(asked, bool) or got is None or float(got.group(1)) == asked:
        return exc
    return InvalidRequest(exc.field, f"{exc.rule}, which the model resolved from the requested {asked}",
                          code=getattr(exc, "code", None))


def make_request(prompt: str | Mapping[str, Any], *, images: Sequence[Any] = (), videos: Sequence[Any] = (),
                 audios: Sequence[Any] = (), inputs: Sequence[MediaInput] = (), negative_prompt: str | None = None,
                 modalities: Sequence[str] | None = None, extra: Mapping[str, Any] | None = None,
                 quality: str = "standard", loras: Sequence[LoRA | str] = (),
                 **sampling_params: Any) -> GenerationRequest:
    """Build a request from keyword arguments; an unknown keyword is an ``InvalidRequest`` naming it."""
    unknown = sorted(set(sampling_params) - _SAMPLING_FIELDS)
    if unknown:
        raise InvalidRequest(unknown[0], f"is not a sampling parameter (known: {sorted(_SAMPLING_FIELDS)})")
    return GenerationRequest(prompt=prompt, params=SamplingParams(**sampling_params), images=tuple(images),
                             videos=tuple(videos), audios=tuple(audios), inputs=tuple(inputs),
                             negative_prompt=negative_prompt, modalities=modalities, extra=extra, quality=quality,
                             loras=tuple(loras))


def _resolve_once(done: asyncio.Future[None]) -> None:
    """Complete ``done`` unless it already is (called on the event loop's thread)."""
    if not done.done():
        done.set_result(None)


class AsyncEngine:
    """asyncio front of an :class:`Engine`: blocking work (preprocess) runs in the loop's executor, results
    and events arrive through futures and queues fed from the worker thread — no model work on the loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def submit(self, request: GenerationRequest, *, on_event: Listener | None = None,
                     limits: WorkLimits | None = None) -> Job:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(self.engine.submit, request, on_event=on_event,
                                                                  limits=limits))

    async def result(self, job: Job) -> list[Output]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def on_event(event: ProgressEvent) -> None:
            if event.phase in TERMINAL_PHASES:
                loop.call_soon_threadsafe(_resolve_once, done)

        job.add_listener(on_event)
        try:
            await done
        finally:
            job.remove_listener(on_event)
        return job.result(0)

    async def events(self, job: Job) -> AsyncIterator[ProgressEvent]:
        """The job's events from now on (starting with its latest one), ending after the terminal event."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[ProgressEvent] = asyncio.Queue()

        def on_event(event: ProgressEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        job.add_listener(on_event)
        try:
            while True:
                event = await queue.get()
                yield event
                if event.phase in TERMINAL_PHASES:
                    return
        finally:
            job.remove_listener(on_event)

    async def stream(self, request: GenerationRequest) -> AsyncIterator[ProgressEvent]:
        """Submit (preprocessing once) and yield the job's events until it ends."""
        job = await self.submit(request)
        async for event in self.events(job):
            yield event

    async def generate(self, prompt: str | Mapping[str, Any], **kwargs: Any) -> list[Output]:
        return await self.result(await self.submit(make_request(prompt, **kwargs)))

    async def close(self, cancel_running: bool = False, timeout: float | None = None) -> bool:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, functools.partial(self.engine.close, cancel_running, timeout))
