"""A worker rank: join the process group, load the model once, then replay rank 0's batch plan step by step.

Rank 0 (the engine's process) announces each batch on the control group: ``("batch", requests[, adapters])``
(encode the prepared requests; ``adapters``, when any request has LoRA adapters, lists each request's
:class:`~omnicore.lora.registry.AdapterRef` — the files and versions rank 0 resolved — which every rank uploads
and reports on before the encode, see :meth:`~.group.WorkerGroup.collect`), ``("step", i)`` (run denoise
step ``i`` through the ``omnicore_denoise`` hook; the adapters of the batch's remaining requests first),
``("select", keep)`` (drop cancelled requests), ``("decode", every_rank)`` (the steps are over; rank 0 decodes,
with every rank taking part when the pipeline shares its VAE tiles out, ``decode_on_every_rank``),
``("end",)`` (forget the batch) and ``("shutdown",)``. Every rank
holds the same latents (CFG and Ulysses results are exchanged inside the model), so replaying the same calls keeps
the ranks in lockstep; only rank 0 decodes and returns outputs.

A worker that fails a step (or a shared decode) sends rank 0 where and why over its report pipe and exits: its
peers' pending collective then fails instead of waiting forever, and rank 0 reports the group broken, naming the
rank and its error. The encode may run collectives too (tensor parallelism): every rank reports how it ended, and
a worker whose encode failed leaves only when the others do not reach that exchange in time
(:mod:`omnicore.parallel.lockstep`). A worker also exits when its parent process disappears (no orphans).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import attrs

from ..platforms.host_memory import HostMemory
from ..vae_fast_paths import request_fast_paths
from .config import ParallelConfig
from .lockstep import OUT_OF_STEP_S, describe, picklable, settle_on_worker, where

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from torch.distributed import ProcessGroup

    from ..engine.protocol import Pipeline
    from ..lora.runtime import LoRARuntime
    from ..plugin_host.host import PluginHost
    from .context import ParallelContext

logger = logging.getLogger("omnicore.parallel")

#: The control group never times out while idle (workers wait for the next batch as long as the server lives);
#: a dead peer still fails a pending call at once (its connection closes).
CONTROL_TIMEOUT_S = 365 * 24 * 3600.0


@attrs.frozen
class RankSpec:
    """What every rank needs to load the same pipeline as rank 0 (picklable: it crosses the spawn)."""

    model: str
    config: ParallelConfig
    backend: str
    platform: str | None = None
    offload: str = "none"
    model_options: Mapping[str, Any] = attrs.field(factory=dict)
    vae_decode_precision: str | None = None
    settings: Mapping[str, Any] | None = None  # Settings.as_dict() of rank 0's engine
    quantization: str | None = None  # weight-only int8/fp8 of the model's declared linears, after the load
    timeout_s: float = 600.0
    cache_methods: tuple[tuple[str, Any], ...] = ()  # (name, config) of rank 0's cache methods, enabled alike
    # (device, host) byte budgets of each rank's LoRA cache (rank 0's --max-lora-bytes; None: unbounded/default)
    lora_budgets: tuple[int | None, int | None] = (None, None)
    # how long a rank whose encode failed waits for the others to end theirs (omnicore.parallel.lockstep)
    out_of_step_s: float = OUT_OF_STEP_S


def init_distributed(backend: str, rank: int, world_size: int, init_method: str | None,
                     timeout_s: float) -> ProcessGroup:
    """Join the default process group (``init_method=None``: torchrun's ``env://``) and create the control group."""
    from datetime import timedelta

    import torch.distributed as dist

    if backend == "hccl":  # torch_npu registers the HCCL backend when imported
        import torch_npu  # noqa: F401

    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    return dist.new_group(list(range(world_size)), backend="gloo", timeout=timedelta(seconds=CONTROL_TIMEOUT_S))


def load_rank_pipeline(spec: RankSpec, ctx: ParallelContext) -> tuple[PluginHost, Pipeline, LoRARuntime | None]:
    """``(host, pipeline, lora)`` of this rank, loaded by the engine's load sequence
    (:func:`omnicore.engine.loading.load_model`) with ``LoadOptions.parallel = ctx``, then offloaded like rank 0;
    ``lora`` is its LoRA runtime (None for a model without LoRA targets), fed the adapters rank 0 announces."""
    from ..config import Settings
    from ..engine.loading import load_model
    from ..offload.policy import apply_offload
    from ..plugin_host.host import PluginHost

    settings = Settings(**dict(spec.settings)) if spec.settings is not None else None
    host = PluginHost(settings)
    target, pipeline = load_model(host, spec.model, host.settings, platform=spec.platform,
                                  model_options=spec.model_options, offload=spec.offload,
                                  vae_decode_precision=spec.vae_decode_precision, parallel=ctx)
    apply_offload(pipeline, spec.offload, target.platform.device())
    if spec.quantization is not None:  # as rank 0 does: replicated / expert-partitioned weights, quantized here
        from ..quantization import apply_to_pipeline

        apply_to_pipeline(pipeline, pipeline.spec, spec.quantization)
    if spec.cache_methods:  # as rank 0 does, after offload: the caches decide alike (omnicore.parallel.consensus)
        methods = host.check_cache_methods([name for name, _ in spec.cache_methods], target.resolved.spec)
        for method, (_, config) in zip(methods, spec.cache_methods):
            host.enable_cache(pipeline, method, config)
    lora = None
    if target.resolved.spec.lora is not None:
        from ..lora.registry import AdapterRegistry
        from ..lora.runtime import LoRARuntime

        registry = AdapterRegistry(max_device_bytes=spec.lora_budgets[0], max_host_bytes=spec.lora_budgets[1])
        lora = LoRARuntime(registry, target.resolved.spec, pipeline, target.platform.ops)
    return host, pipeline, lora


def receive(control: ProcessGroup) -> Any:
    """The next command rank 0 broadcasts on the control group."""
    import torch.distributed as dist

    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]


class CommandFailed(RuntimeError):
    """A command of rank 0's batch plan failed on this worker: ``where`` names the phase
    (:func:`omnicore.parallel.lockstep.where`), the cause is the error."""

    def __init__(self, where: str, cause: BaseException) -> None:
        super().__init__(f"{where} ({describe(cause)})")
        self.where = where
        self.__cause__ = cause


@attrs.define
class _Batch:
    """What a worker holds of the running batch: its state (None: none, or this rank failed to encode it), its
    requests and their adapters (shrunk with the state)."""

    state: Any = None
    requests: list[Any] = attrs.Factory(list)
    adapters: list[Any] | None = None


def serve_commands(host: PluginHost, pipeline: Pipeline, control: ProcessGroup,
                   lora: LoRARuntime | None = None, *, out_of_step_s: float = OUT_OF_STEP_S,
                   leave: Callable[[str], object] | None = None) -> None:
    """Replay rank 0's batch plan until ``shutdown``; raises :class:`CommandFailed` on the first failing command.
    ``leave(text)`` reports ``text`` (where and why) to rank 0 and ends this process: called when a failed encode
    leaves the ranks out of step (default: exit without a report)."""
    batch = _Batch()
    while True:
        command = receive(control)
        if command[0] == "shutdown":
            return
        try:
            _serve(command, batch, host, pipeline, control, lora, out_of_step_s, leave or _leave_unreported)
        except BaseException as exc:  # (a step's SystemExit too: this rank leaves, telling rank 0 why)
            raise CommandFailed(where(command), exc) from exc


def _serve(command: Any, batch: _Batch, host: PluginHost, pipeline: Pipeline, control: ProcessGroup,
           lora: LoRARuntime | None, out_of_step_s: float, leave: Callable[[str], object]) -> None:
    """Run one command of the batch plan on ``batch``."""
    kind = command[0]
    if kind == "batch":
        batch.state, batch.requests = None, list(command[1])
        batch.adapters = list(command[2]) if len(command) > 2 and command[2] is not None else None
        if batch.adapters is not None and not _upload_adapters(lora, batch.requests, batch.adapters, control):
            return  # rank 0 fails the batch with this rank's error and ends it
        error: Exception | None = None
        try:  # may run collectives (tensor parallelism): every rank then reports how its encode ended
            batch.state = pipeline.encode(command[1])
        except Exception as exc:
            logger.warning("this rank's encode failed; reporting to rank 0", exc_info=True)
            error = exc
        settle_on_worker(control, error, out_of_step_s, leave)  # rank 0 fails the batch on any rank's error
    elif kind == "step":
        if batch.state is None:  # rank 0 encoded what this rank could not: the ranks have diverged
            raise RuntimeError("rank 0 ran a step of a batch this rank failed to encode")
        if batch.adapters is not None and lora is not None:  # as rank 0's runner does before every step
            lora.activate(batch.requests, batch.adapters)
        batch.state = host.denoise(pipeline=pipeline, state=batch.state, step=command[1])
    elif kind == "select":
        if batch.state is None:
            raise RuntimeError("rank 0 shrank a batch this rank failed to encode")
        shrunk = pipeline.select_requests(batch.state, command[1])
        if shrunk is not None:
            batch.state = shrunk
            batch.requests = [batch.requests[i] for i in command[1]]
            batch.adapters = None if batch.adapters is None else [batch.adapters[i] for i in command[1]]
    elif kind == "decode":  # rank 0 decodes alone, unless the pipeline shares the tiles out over the ranks
        if len(command) > 1 and command[1]:
            if batch.state is None:
                raise RuntimeError("rank 0 decoded a batch this rank failed to encode")
            # this rank's tiles (rank 0 gathers them and keeps the outputs), with the VAE fast-path gate set as rank
            # 0's runner sets it for the batch: a "high" batch's tiles all take the fast ops, or none does
            with request_fast_paths(pipeline, {r.quality for r in batch.requests}):
                pipeline.decode(batch.state)
    elif kind == "end":
        batch.state, batch.requests, batch.adapters = None, [], None
        if lora is not None:
            lora.deactivate()
    else:
        raise RuntimeError(f"unknown command from rank 0: {kind!r}")


def _upload_adapters(lora: LoRARuntime | None, requests: list[Any], adapters: list[Any],
                     control: ProcessGroup) -> bool:
    """Activate the batch's adapters (the versions rank 0 named) and report to rank 0 whether that worked."""
    import torch.distributed as dist

    error: BaseException | None = None
    try:
        if lora is None:
            raise RuntimeError("this rank's model has no LoRA runtime")
        lora.activate(requests, adapters)
    except Exception as exc:
        logger.warning("could not upload the batch's LoRA adapters", exc_info=True)
        error = exc
    dist.gather_object(picklable(error), None, dst=0, group=control)
    return error is None


@attrs.frozen
class RankLoad:
    """What a worker tells rank 0 once its load ended: its error (``None``: loaded) and its host memory then
    (``peak_rss_bytes``: the most the worker process has held since it was spawned, i.e. its startup peak)."""

    error: str | None
    memory: HostMemory


def report_ready(control: ProcessGroup, error: BaseException | None) -> None:
    """Tell rank 0 whether this rank loaded, and its host memory (every rank calls this once, in rank order of the
    gather)."""
    import torch.distributed as dist

    report = RankLoad(None if error is None else f"{type(error).__name__}: {error}", HostMemory.now())
    dist.gather_object(report, None, dst=0, group=control)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the spawning process is gone (re-parented), so a killed server leaves no workers behind."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(3)
        time.sleep(0.5)


def worker_main(rank: int, init_method: str, spec: RankSpec, parent_pid: int,
                report: Connection | None = None) -> None:
    """Entry point of a spawned worker process (``report``: the write end of its pipe to rank 0's monitor)."""
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 ends us
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="omnicore-parent-watch").start()
    run_rank(rank, init_method, spec, report)


def _leave(rank: int, report: Connection | None, text: str) -> NoReturn:
    """End this worker after a failure, first telling rank 0 where and why (``text``) when it has a report pipe
    (a spawned worker; a torchrun rank's failure shows in its log and as a peer leaving)."""
    logger.error("rank %d failed in %s; leaving the group", rank, text)
    if report is not None:
        try:
            report.send(text)
        except Exception:  # rank 0 is gone: nobody to tell
            pass
    os._exit(1)


def _leave_unreported(text: str) -> NoReturn:
    logger.error("failed in %s; leaving the group", text)
    os._exit(1)


def run_rank(rank: int, init_method: str | None, spec: RankSpec, report: Connection | None = None) -> None:
    """Join the group, load, report, serve; exit the process on any failure (see the module docstring)."""
    from .context import build_groups

    try:
        control = init_distributed(spec.backend, rank, spec.config.world_size, init_method, spec.timeout_s)
        ctx = build_groups(spec.config, rank)
    except BaseException:
        logger.exception("rank %d could not join the process group", rank)
        os._exit(1)
    error: BaseException | None = None
    try:
        host, pipeline, lora = load_rank_pipeline(spec, ctx)
    except BaseException as exc:  # reported to rank 0, which raises it from Engine()
        error = exc
    try:
        report_ready(control, error)
        if error is not None:
            receive(control)  # rank 0 ends the group after any rank failed to load
        else:
            serve_commands(host, pipeline, control, lora, out_of_step_s=spec.out_of_step_s,
                           leave=lambda text: _leave(rank, report, text))
    except CommandFailed as exc:
        logger.error("rank %d failed", rank, exc_info=exc.__cause__)
        _leave(rank, report, str(exc))
    except BaseException:
        logger.exception("rank %d failed; leaving the group", rank)
        os._exit(1)
    _finish()


def _finish() -> None:
    import torch.distributed as dist

    try:
        dist.destroy_process_group()
    except Exception:  # the group may already be torn down by rank 0
        pass


__all__ = ["CommandFailed", "RankLoad", "RankSpec", "init_distributed", "load_rank_pipeline", "run_rank",
           "serve_commands", "worker_main"]
