"""One call of a stock diffusers pipeline, run on its own thread and advanced one denoise step at a time.

diffusers runs the whole loop inside ``__call__``; omnicore's engine wants to call ``denoise_step`` once per
step (that is where it emits progress and checks cancellation). ``SteppedCall`` bridges the two without forking
diffusers: the call runs on a worker thread and parks at two kinds of points until the engine lets it go on:

- before the denoiser's first forward (a forward pre-hook on the transformer / UNet): text encoding and the
  initial latents are done, and ``pipe._num_timesteps`` says how many steps the loop will take (``encode``);
- at the end of every step, in ``callback_on_step_end`` (``denoise_step``); after the last step the pipeline
  decodes when the engine calls ``decode``. A modular pipeline has no such callback: there the call parks right
  after each ``scheduler.step`` returns (the denoise loop calls it once per step), given ``scheduler``.

Aborting (a cancelled batch, an engine error, the state being dropped) makes the parked call raise
``Aborted`` out of the pipeline, so it stops within the step it is in and never decodes.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any


class Aborted(Exception):
    """Raised inside the pipeline's call to leave it (never reaches a caller)."""


class _QuietAbort(logging.Filter):
    """Drops the error diffusers' modular blocks log for every block an exception passes through, when that
    exception is our own :class:`Aborted` (a cancel, not a failure; the filter runs inside their ``except``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not isinstance(sys.exc_info()[1], Aborted)


logging.getLogger("diffusers.modular_pipelines.modular_pipeline").addFilter(_QuietAbort())


class SteppedCall:
    """The pipeline call ``fn(**kwargs, callback_on_step_end=...)`` parked at step boundaries."""

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any], denoisers: Sequence[Any],
                 num_timesteps: Callable[[], int | None], scheduler: Any = None) -> None:
        self._fn, self._kwargs, self._num_timesteps = fn, kwargs, num_timesteps
        self._scheduler = scheduler  # set: step ends are detected after scheduler.step (no callback taken)
        self._steps_done = 0
        self._to_worker: queue.Queue[str] = queue.Queue()
        self._to_engine: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._started = False
        self._hooks = [m.register_forward_pre_hook(self._first_forward) for m in denoisers]
        self.result: Any = None
        self.finished = False
        self.step_times: list[float] = []
        self._go_at = 0.0
        self._thread = threading.Thread(target=self._main, name="omni-diffusers-call", daemon=True)

    # ------------------------------------------------------------------ worker side
    def _main(self) -> None:
        try:
            if self._scheduler is None:
                out = self._fn(**self._kwargs, callback_on_step_end=self._step_end)
            else:
                out = self._call_parking_after_scheduler_steps()
            self._to_engine.put(("result", out))
        except Aborted:
            self._to_engine.put(("aborted", None))
        except BaseException as exc:  # handed to the engine thread, which raises it there
            self._to_engine.put(("error", exc))
        finally:
            for hook in self._hooks:
                hook.remove()

    def _call_parking_after_scheduler_steps(self) -> Any:
        scheduler = self._scheduler
        original = scheduler.step

        def step(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            self._to_engine.put(("step", self._steps_done))
            self._steps_done += 1
            self._park()
            return out

        scheduler.step = step  # an instance attribute: the class's method is untouched
        try:
            return self._fn(**self._kwargs)
        finally:
            del scheduler.step

    def _park(self) -> None:
        if self._to_worker.get() == "abort":
            raise Aborted

    def _first_forward(self, module: Any, args: Any) -> None:
        if self._started:
            return
        self._started = True
        self._to_engine.put(("ready", self._num_timesteps()))
        self._park()

    def _step_end(self, pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        self._to_engine.put(("step", step))
        self._park()
        return {}

    # ------------------------------------------------------------------ engine side
    def _receive(self) -> tuple[str, Any]:
        kind, value = self._to_engine.get()
        if kind == "error":
            self.finished = True
            self._thread.join()
            raise value
        if kind in ("result", "aborted"):
            self.finished, self.result = True, value
            self._thread.join()
        return kind, value

    def start(self) -> int | None:
        """Run up to the first denoiser forward; returns the number of steps (``None``: the call already ended)."""
        self._thread.start()
        kind, value = self._receive()
        return value if kind == "ready" else None

    def step(self, index: int) -> None:
        """Let the pipeline run one step and wait until it ended (its callback ran)."""
        if self.finished:
            return
        self._go_at = time.perf_counter()
        self._to_worker.put("go")
        kind, value = self._receive()
        self.step_times.append(time.perf_counter() - self._go_at)
        if kind == "step" and value != index:
            self.abort()
            raise RuntimeError(f"the diffusers pipeline reported step {value} where the engine ran step {index}")

    def finish(self) -> Any:
        """Let the pipeline decode and return its output object."""
        while not self.finished:
            self._to_worker.put("go")
            self._receive()
        return self.result

    def abort(self, wait: bool = True) -> None:
        """Make the parked call raise out of the pipeline (idempotent); ``wait``: until its thread ended."""
        if self.finished or not self._thread.is_alive():
            return
        self._to_worker.put("abort")
        if wait:
            self._thread.join(timeout=600)
