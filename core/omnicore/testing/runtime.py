"""Helpers of the runtime checks of :class:`~omnicore.testing.ModelPluginConformance`: holding the engine's worker
so requests queue up into one batch, a spy attention backend, progress-event rules and output comparison.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TYPE_CHECKING

import attrs

from ..engine.progress import PHASES
from ..hookspecs import hookimpl
from ..specs import AttentionBackendSpec, resolve

if TYPE_CHECKING:
    import torch

    from ..engine.api import Engine
    from ..engine.jobs import Job
    from ..engine.progress import ProgressEvent
    from ..engine.protocol import DenoiseState, Pipeline
    from ..engine.request import GenerationRequest
    from ..outputs.output import Output
    from ..plugin_host.host import PluginHost

#: Name of the spy backend the attention check forces (``--attention-backend`` with this name).
SPY_BACKEND = "omnicore-conformance-spy"
_spy: dict[str, int | str] = {"calls": 0, "target": "omnicore.attention.reference:sdpa_attention"}
_spy_lock = threading.Lock()

#: Order in which a job's phases may appear (``queued`` is skipped when the worker starts it at once).
PHASE_ORDER = ("preprocess", "queued", "encode", "denoise", "decode", "postprocess", "done")


def spy_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """Counts its calls, then runs the backend it copies (the core's SDPA reference unless told otherwise)."""
    with _spy_lock:
        _spy["calls"] = int(_spy["calls"]) + 1
    attention: Callable[..., torch.Tensor] = resolve(str(_spy["target"]))
    return attention(q, k, v, **kwargs)


def spy_calls() -> int:
    return int(_spy["calls"])


class SpyAttentionPlugin:
    """Registers :data:`SPY_BACKEND`: the capabilities and implementation of backend ``base`` with a call counter."""

    def __init__(self, base: AttentionBackendSpec) -> None:
        self.base = base

    @hookimpl
    def omnicore_register_attention_backends(self, register: Callable[[AttentionBackendSpec], None]) -> None:
        _spy["target"], _spy["calls"] = self.base.impl, 0
        register(attrs.evolve(self.base, name=SPY_BACKEND, impl="omnicore.testing.runtime:spy_attention",
                              provider="", description=f"conformance spy over {self.base.name!r}"))


class StepCounter:
    """A denoise-hook wrapper counting, per request id, the steps computed for a batch holding that request."""

    def __init__(self) -> None:
        self.steps: dict[str, int] = {}

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline: Pipeline, state: DenoiseState,
                         step: int) -> Generator[None, DenoiseState | None, DenoiseState | None]:
        for request in getattr(state, "requests", ()):
            self.steps[request.request_id] = self.steps.get(request.request_id, 0) + 1
        return (yield)


@contextlib.contextmanager
def counting_steps(host: PluginHost) -> Iterator[StepCounter]:
    counter = StepCounter()
    name = f"omnicore-conformance-steps-{id(counter):x}"
    host.pm.register(counter, name=name)
    try:
        yield counter
    finally:
        host.pm.unregister(counter, name=name)


@contextlib.contextmanager
def held_worker(engine: Engine, request: GenerationRequest, timeout: float = 120.0) -> Iterator[Job]:
    """Run ``request`` and keep the engine's worker inside its ``encode`` until the block ends, so every request
    submitted inside the block waits in the queue and the scheduler forms one batch of them afterwards.
    Yields the holding job; on exit it is released and awaited."""
    release, holding = threading.Event(), threading.Event()

    def hold(event: ProgressEvent) -> None:
        if event.phase == "encode" and not holding.is_set():
            holding.set()
            release.wait(timeout)

    job = engine.submit(request, on_event=hold)
    try:
        assert holding.wait(timeout), "the engine never started the holding request"
        yield job
    finally:
        release.set()
        job.wait(timeout)


def check_progress_events(events: Sequence[ProgressEvent], min_steps: int) -> None:
    """A finished job's events: phases in order, one ``denoise`` event per step 1..T, monotone progress to 1."""
    phases = [e.phase for e in events]
    assert phases and phases[-1] == "done", f"the job did not end with 'done': {phases}"
    ranks = [PHASE_ORDER.index(p) for p in phases if p in PHASE_ORDER]
    assert ranks == sorted(ranks), f"phases out of order: {phases}"
    assert set(phases) <= set(PHASES), f"unknown phases in {phases}"
    steps = [e.step for e in events if e.phase == "denoise"]
    totals = {e.total_steps for e in events if e.phase == "denoise"}
    assert len(totals) == 1, f"denoise events disagree on total_steps: {sorted(totals)}"
    total = totals.pop()
    assert total >= min_steps, f"total_steps {total} is below the {min_steps} requested steps"
    assert steps == list(range(1, total + 1)), f"expected one denoise event per step 1..{total}, got steps {steps}"
    progress = [e.progress for e in events]
    assert all(b >= a for a, b in zip(progress, progress[1:])), f"progress went backwards: {progress}"
    assert progress[-1] == 1.0, f"a finished job ends at progress 1.0, got {progress[-1]}"


def assert_close_outputs(actual: Sequence[Output], expected: Sequence[Output], max_abs_diff: int,
                         audio_atol: float, what: str) -> None:
    """Same kinds, shapes, fps and seeds; frames within ``max_abs_diff`` (uint8 levels), audio within ``audio_atol``."""
    import numpy as np

    assert len(actual) == len(expected), f"{what}: {len(actual)} outputs, expected {len(expected)}"
    for a, e in zip(actual, expected):
        assert (a.kind, a.frames.shape, a.fps, a.seed) == (e.kind, e.frames.shape, e.fps, e.seed), what
        diff = int(np.abs(a.frames.astype(np.int16) - e.frames.astype(np.int16)).max())
        assert diff <= max_abs_diff, f"{what}: frames differ by up to {diff} levels (tolerance {max_abs_diff})"
        assert (a.audio is None) == (e.audio is None), what
        if a.audio is not None and e.audio is not None:
            assert a.sample_rate == e.sample_rate and a.audio.shape == e.audio.shape, what
            assert np.allclose(a.audio, e.audio, atol=audio_atol), f"{what}: audio differs beyond {audio_atol}"
