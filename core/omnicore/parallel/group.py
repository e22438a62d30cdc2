"""Rank 0's handle on a worker group: start it, announce each batch's plan, watch the workers, end them.

:meth:`WorkerGroup.start` spawns ``world_size - 1`` worker processes (``torch.multiprocessing``, spawn) on a
local rendezvous, or attaches to a ``torchrun`` launch (``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` set): there the
non-zero ranks serve the group from inside ``Engine(...)`` and exit the process when rank 0 shuts it down.

Failure handling: a monitor thread waits on the spawned processes and on their report pipes (a worker that fails
sends where and why before it exits); when one exits unexpectedly the group is *broken*: the remaining workers
are ended, rank 0 aborts its communicators on NCCL/HCCL (on gloo the closed connections already fail a pending
collective), the engine reports itself unhealthy (``Engine.worker_alive``), the running batch fails with
:class:`WorkerGroupBroken` naming the rank, its error and its exit code, and later batches fail at once with the
same error. When rank 0 itself fails inside a step or a shared decode the workers may be waiting in a collective
it will never enter: the group is ended the same way (spawned workers are signalled; torchrun ranks leave when
that collective times out, ``RankSpec.timeout_s``). The encode, which runs collectives under tensor parallelism,
ends with every rank reporting how it went (:meth:`WorkerGroup.encoding`): a failure every rank shares only fails
the batch; one that leaves the ranks out of step ends the group (:mod:`omnicore.parallel.lockstep`).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, OmnicoreError
from .context import ParallelContext, build_groups
from .lockstep import deadline, describe, note_rank
from .worker import RankLoad, RankSpec, init_distributed, run_rank, worker_main

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from torch.distributed import ProcessGroup

    from ..platforms.host_memory import HostMemory

logger = logging.getLogger("omnicore.parallel")

#: Environment variable that pins a worker to one device, per device type (each spawned rank sees its own
#: device as index 0, so pipelines keep using ``platform.device()``).
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


class WorkerGroupBroken(OmnicoreError, RuntimeError):
    """A rank of the engine's worker group died or failed; the group cannot run steps any more."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torchrun_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process was launched by ``torchrun`` (or any ``env://`` launcher)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


@contextmanager
def _visible_device(device_type: str, rank: int) -> Iterator[None]:
    """Spawn the worker of ``rank`` seeing only device ``rank`` (of the devices visible to rank 0)."""
    name = VISIBLE_DEVICES.get(device_type)
    if name is None:
        yield
        return
    before = os.environ.get(name)
    visible = before.split(",") if before else None
    os.environ[name] = visible[rank] if visible and rank < len(visible) else str(rank)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


class WorkerGroup:
    """Rank 0 of a parallel engine (see the module docstring)."""

    def __init__(self, spec: RankSpec, control: ProcessGroup, ctx: ParallelContext,
                 processes: list[BaseProcess], reports: list[Connection] | None = None) -> None:
        self.spec = spec
        self.control = control
        self.ctx = ctx
        self.processes = processes  # spawned workers, rank 1.. (empty when attached to torchrun)
        self.failure: str | None = None
        #: each rank's host memory at the end of its load (index = rank; None where it was not reported)
        self.load_memory: list[HostMemory | None] = [None] * ctx.world_size
        self._own_failure = False  # the group was ended because rank 0 itself failed mid-step
        self._checked: BaseException | None = None  # the last error looked at by explain()
        # the step (or "decode") announced last, until the next command says it completed
        self._stepping: int | str | None = None
        self._stopping = False
        self._lock = threading.Lock()
        # read ends of the spawned workers' report pipes (rank -> pipe) and what each said before it left
        self._reports: dict[int, Connection] = dict(enumerate(reports or (), start=1))
        self._said: dict[int, str] = {}
        self._reports_lock = threading.Lock()
        self._monitor = None
        if processes:
            self._monitor = threading.Thread(target=self._watch, name="omnicore-parallel-monitor", daemon=True)
            self._monitor.start()

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, spec: RankSpec, device_type: str = "cpu") -> WorkerGroup:
        """Spawn the workers (or attach to torchrun) and join the process group as rank 0."""
        launched = torchrun_rank()
        world = spec.config.world_size
        if launched is not None:
            rank, size = launched
            if size != world:
                raise ConfigError("parallel", f"{spec.config} needs {world} ranks but torchrun started {size}")
            if rank != 0:  # a torchrun worker: serve rank 0 until it shuts the group down, then leave
                run_rank(rank, None, spec)
                raise SystemExit(0)
            control = init_distributed(spec.backend, 0, world, None, spec.timeout_s)
            return cls(spec, control, build_groups(spec.config, 0), [])
        import torch.multiprocessing as mp

        init_method = f"tcp://127.0.0.1:{_free_port()}"
        context = mp.get_context("spawn")
        processes: list[BaseProcess] = []
        reports: list[Connection] = []
        for rank in range(1, world):
            reader, writer = context.Pipe(duplex=False)  # the worker tells rank 0 where and why it failed
            process = context.Process(target=worker_main, args=(rank, init_method, spec, os.getpid(), writer),
                                      name=f"omnicore-rank{rank}", daemon=True)
            with _visible_device(device_type, rank):
                process.start()
            writer.close()  # the worker holds it now: its exit closes the pipe
            processes.append(process)
            reports.append(reader)
        try:
            control = _join_watching(spec, init_method, processes)
            ctx = build_groups(spec.config, 0)
        except BaseException:
            _end_processes(processes)
            raise
        return cls(spec, control, ctx, processes, reports)

    def finish_load(self, error: BaseException | None, memory: HostMemory | None = None) -> None:
        """Collect every rank's load result; on any failure end the group and raise (rank 0's own error first).
        ``memory`` is rank 0's host memory at the end of its load; :attr:`load_memory` then holds every rank's."""
        import torch.distributed as dist

        statuses: list[Any] = [None] * self.ctx.world_size
        try:
            dist.gather_object(None, statuses, dst=0, group=self.control)
        except Exception as exc:
            self.shutdown()
            raise WorkerGroupBroken(f"a worker died while loading the model: {self.failure or exc}") from exc
        self.load_memory = [memory, *(s.memory if isinstance(s, RankLoad) else None for s in statuses[1:])]
        failed = [(rank, s.error) for rank, s in enumerate(statuses) if isinstance(s, RankLoad) and s.error]
        if error is None and not failed:
            return
        self.shutdown()
        if error is not None:  # rank 0's own error, typed as it was raised; the traceback names the ranks
            others = ", ".join(str(r) for r, _ in failed) or "none"
            add_note = getattr(error, "add_note", None)  # (Python 3.11+)
            if add_note is not None:
                add_note(f"(raised on rank 0 of {self.ctx.world_size} while loading; other ranks that failed: "
                         f"{others})")
            raise error
        rank, message = failed[0]
        raise ConfigError("parallel", f"rank {rank} failed to load the model: {message}")

    # ------------------------------------------------------------------ plan
    @property
    def healthy(self) -> bool:
        return self.failure is None and not self._stopping

    def announce(self, kind: str, *args: Any) -> None:
        """Broadcast one command of the batch plan to every worker (rank 0 then runs it itself)."""
        import torch.distributed as dist

        if self.failure is not None:
            raise WorkerGroupBroken(self.failure)
        self._stepping = None
        try:
            dist.broadcast_object_list([(kind, *args)], src=0, group=self.control)
        except Exception as exc:
            raise self.explain(exc) from exc
        if kind == "step":
            self._stepping = args[0]
        elif kind == "decode" and args and args[0]:  # a decode every rank takes part in: ranks in lockstep
            self._stepping = "decode"

    def collect(self) -> None:
        """After a command every worker reports on (``("batch", requests, adapters)``: each rank uploaded the
        batch's LoRA adapters): raise the first worker's error, with a note naming its rank (the batch then fails
        and is ended on every rank; the group stays healthy)."""
        import torch.distributed as dist

        statuses: list[Any] = [None] * self.ctx.world_size
        try:
            dist.gather_object(None, statuses, dst=0, group=self.control)
        except Exception as exc:
            raise self.explain(exc) from exc
        for rank, error in enumerate(statuses):
            if isinstance(error, BaseException):
                note_rank(error, rank, self.ctx.world_size)
                raise error

    @contextmanager
    def encoding(self) -> Iterator[None]:
        """Rank 0's encode of the announced batch. Then every rank reports how its encode ended (it may have run
        collectives): the first error is raised, noted with its rank, and the group stays in step; when rank 0's
        encode failed and a worker has not ended its own ``RankSpec.out_of_step_s`` later, that worker waits in a
        collective rank 0 skipped: the group is ended (:mod:`omnicore.parallel.lockstep`)."""
        self._stepping = "encode"  # (fail_batch ends the group should the exchange below not happen)
        error: BaseException | None = None
        try:
            yield
        except BaseException as exc:
            error = exc
        self._settle(error)

    def _settle(self, error: BaseException | None) -> None:
        import torch.distributed as dist

        if error is not None and (self.failure is not None or isinstance(error, WorkerGroupBroken)):
            raise self.explain(error)  # the group broke while rank 0 encoded: nobody to exchange with
        statuses: list[Any] = [None] * self.ctx.world_size

        def out_of_step() -> None:
            assert error is not None
            self._own_failure = True
            self._mark_broken(f"rank 0 failed in the encode ({describe(error)}); the other ranks had not ended "
                              f"theirs {self.spec.out_of_step_s:g} s later, so the ranks are out of step")
        try:
            with deadline(self.spec.out_of_step_s if error is not None else None, out_of_step):
                dist.gather_object(None, statuses, dst=0, group=self.control)
        except Exception as exc:  # a worker left (its pipe says why), or the deadline ended the workers
            broken = self.explain(error if self._own_failure and error is not None else exc)
            raise broken from broken.__cause__
        if self.failure is not None:  # the deadline passed as the exchange ended: the workers are gone anyway
            raise self.explain(error or RuntimeError("the worker group broke during the encode"))
        self._stepping = None  # every rank ended its encode: in step again
        failed = [rank for rank, status in enumerate(statuses) if isinstance(status, BaseException)]
        first = error if error is not None else statuses[failed[0]] if failed else None
        if first is not None:
            note_rank(first, 0 if error is not None else failed[0], self.ctx.world_size, "the encode",
                      failed if error is not None else failed[1:])
            self._checked = first  # every rank is alive and in step: explain() need not look for a dead one
            raise first

    def end_batch(self) -> None:
        """Tell the workers the batch is over (never raises: it runs while a failure is being reported)."""
        if self.failure is None:
            try:
                self.announce("end")
            except Exception:
                logger.warning("could not end the batch on the workers: %s", self.failure)

    def fail_batch(self, exc: BaseException) -> None:
        """Rank 0's batch raised ``exc``. Outside a step the workers just drop the batch; inside one they may be
        waiting in a collective rank 0 will never enter, so the group is ended (no hang) and reported broken."""
        self.explain(exc)  # records a dead worker first, if that is what happened
        if self.failure is None and self._stepping is not None:
            self._own_failure = True
            where = {"decode": "the parallel VAE decode", "encode": "the encode"}.get(str(self._stepping),
                                                                                  f"denoise step {self._stepping}")
            self._mark_broken(f"rank 0 failed in {where} ({describe(exc)}); the ranks are out of step")
        self.end_batch()

    def explain(self, exc: BaseException) -> BaseException:
        """The error to report for ``exc`` raised during a batch: a :class:`WorkerGroupBroken` naming the rank when
        the group broke (a worker died or failed, or rank 0's own failure ended it; ``exc`` is its cause), else
        ``exc`` itself (the group is still in step)."""
        if isinstance(exc, WorkerGroupBroken):
            return exc
        if self.failure is None and exc is not self._checked:
            self._checked = exc
            self._check_processes(wait_s=1.0)  # give a dying worker a moment to be seen
            if self.failure is None and _looks_like_peer_loss(exc):
                # the transport noticed first: a worker is exiting; name it once it has (bounded wait)
                deadline = time.monotonic() + 5.0
                while self.failure is None and time.monotonic() < deadline and self.processes:
                    self._check_processes(wait_s=0.2)
                if self.failure is None:
                    self._mark_broken(f"a peer rank left the process group ({type(exc).__name__}: {exc})")
        if self.failure is not None:
            broken = WorkerGroupBroken(f"parallel worker group failed: {self.failure}")
            broken.__cause__ = exc
            return broken
        return exc

    # ------------------------------------------------------------------ health
    def _check_processes(self, wait_s: float = 0.0) -> None:
        """Mark the group broken if a worker exited (waiting up to ``wait_s`` for one to)."""
        by_sentinel: dict[Any, BaseProcess] = {p.sentinel: p for p in self.processes}
        for sentinel in multiprocessing.connection.wait(list(by_sentinel), timeout=wait_s) if by_sentinel else ():
            by_sentinel[sentinel].join(2.0)  # its pipe closes while it exits: reap it so the exit code is known
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive() and not self._stopping:
                said = self._read_reports().get(rank)
                self._mark_broken(f"worker rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                                  + (f" after it failed in {said}" if said else ""))
                return

    def _read_reports(self) -> dict[int, str]:
        """What each worker reported before leaving (read from the pipes now; a closed pipe is dropped)."""
        with self._reports_lock:
            for rank, pipe in list(self._reports.items()):
                try:
                    while pipe.poll():
                        self._said[rank] = str(pipe.recv())
                except (EOFError, OSError):
                    pipe.close()
                    del self._reports[rank]
            return dict(self._said)

    def _mark_broken(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        logger.error("parallel worker group broken: %s; ending the other workers", reason)
        _end_processes([p for p in self.processes if p.is_alive()])
        if self.spec.backend != "gloo":
            _abort_communicators()

    def _watch(self) -> None:
        sentinels = {p.sentinel for p in self.processes}
        while not self._stopping and self.failure is None:
            with self._reports_lock:
                pipes = list(self._reports.values())
            try:
                ready = multiprocessing.connection.wait([*sentinels, *pipes], timeout=0.5)
            except (OSError, ValueError):  # a pipe closed under us: shutdown has begun
                return
            if any(r not in sentinels for r in ready):
                self._read_reports()
            if any(r in sentinels for r in ready):
                if not self._stopping:
                    self._check_processes()
                return

    # ------------------------------------------------------------------ shutdown
    def shutdown(self, timeout: float = 10.0) -> None:
        """End every worker (asked to leave first, ended by signal when they do not) and leave the group."""
        import torch.distributed as dist

        if self._stopping:
            return
        if self.failure is None:
            try:
                dist.broadcast_object_list([("shutdown",)], src=0, group=self.control)
            except Exception as exc:
                logger.warning("could not ask the workers to stop: %s", exc)
        self._stopping = True
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        _end_processes([p for p in self.processes if p.is_alive()])
        with self._reports_lock:
            for pipe in self._reports.values():
                pipe.close()
            self._reports.clear()
        try:
            dist.destroy_process_group()
        except Exception as exc:  # pragma: no cover - best effort while tearing down
            logger.warning("destroying the process group failed: %s", exc)


def _looks_like_peer_loss(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe", "peer", "timed out"))


def _abort_communicators() -> None:
    """Abort rank 0's NCCL/HCCL communicators, so a collective it waits in for a rank that is gone returns now
    instead of at the process group's timeout (gloo needs none of this: a dead peer closes the connection).
    Unverified on NCCL/HCCL hardware; best effort (torch's experimental ``_abort_process_group``)."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    except Exception as exc:  # pragma: no cover - accelerator backends only
        logger.warning("could not abort the process group's communicators: %s", exc)


def _join_watching(spec: RankSpec, init_method: str, processes: list[BaseProcess]) -> ProcessGroup:
    """Join the process group as rank 0 while watching the spawned workers (a worker that dies before joining
    fails the start at once instead of after the rendezvous timeout)."""
    result: dict[str, ProcessGroup | BaseException] = {}

    def join() -> None:
        try:
            result["control"] = init_distributed(spec.backend, 0, spec.config.world_size, init_method, spec.timeout_s)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=join, name="omnicore-parallel-join", daemon=True)
    thread.start()
    deadline = time.monotonic() + spec.timeout_s
    while thread.is_alive():
        thread.join(0.2)
        dead = [(i, p) for i, p in enumerate(processes, start=1) if not p.is_alive()]
        if dead and thread.is_alive():
            rank, process = dead[0]
            raise WorkerGroupBroken(f"worker rank {rank} exited with code {process.exitcode} before joining the "
                                    "process group")
        if time.monotonic() > deadline:
            raise WorkerGroupBroken(f"the workers did not join the process group within {spec.timeout_s:.0f} s")
    control = result.get("error", result.get("control"))
    if isinstance(control, BaseException):
        raise control
    assert control is not None
    return control


def _end_processes(processes: list[BaseProcess], grace: float = 3.0) -> None:
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(1.0)


__all__ = ["WorkerGroup", "WorkerGroupBroken", "torchrun_rank"]
