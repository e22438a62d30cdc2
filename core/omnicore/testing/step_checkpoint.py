"""Conformance check for a model that declares checkpointable step state (``ModelCapabilities.checkpointable``).

:func:`check_step_checkpoints` runs one request three ways on the same engine: uninterrupted; with a step checkpoint
written to disk after every step; and once resumed from each of those files. Every resumed run must execute only
the remaining steps and end with the uninterrupted run's final latents, bit for bit (the latents ``decode`` is
handed, compared with ``torch.equal``), so on CPU a replica that re-claims the job gives the same output.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import attrs


def _final_latents(engine: Any, request: Any, plan: Any) -> tuple[Any, int, float]:
    """(the final latents of ``request``, steps the engine executed, the output's ``resumed_from_step``)."""
    pipeline = engine.pipeline
    decode = pipeline.decode
    seen: list[Any] = []

    def recording(state: Any) -> Any:
        latents = state.latents
        seen.append(tuple(t.clone() for t in latents) if isinstance(latents, tuple) else latents.clone())
        return decode(state)

    pipeline.decode = recording
    try:
        before = engine.stats()["steps_executed"]
        # a fresh id per run (the engine keys a resumed job's batch by it)
        outputs = engine.submit(attrs.evolve(request, request_id=f"{request.request_id}-{len(seen)}-{id(plan)}"),
                                checkpoint=plan).result(600)
        executed = engine.stats()["steps_executed"] - before
    finally:
        del pipeline.decode  # back to the class's method
    return seen[-1], executed, float(outputs[0].metrics.get("resumed_from_step", 0))


def _equal(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, tuple):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return bool(torch.equal(a, b))


def check_step_checkpoints(engine: Any, request: Any, *, steps: int | None = None) -> list[int]:
    """Assert that ``request`` (a ``GenerationRequest`` with a seed) resumes bit-identically from a step checkpoint
    taken after each step; returns the steps checked. ``steps`` limits the check to the first few snapshots."""
    from ..engine.step_checkpoint import CheckpointPlan, read_snapshot, write_snapshot

    assert engine.spec.capabilities.checkpointable, f"model {engine.spec.name!r} does not declare checkpointable"
    plain, executed, _ = _final_latents(engine, request, None)
    total = executed
    with tempfile.TemporaryDirectory(prefix="omnicore-ckpt-") as tmp:
        files: list[Path] = []
        saving = CheckpointPlan(every=1, save=lambda s: files.append(write_snapshot(s, Path(tmp) / f"s{s.step}")))
        with_saves, _, _ = _final_latents(engine, request, saving)
        assert _equal(with_saves, plain), "writing step checkpoints changed the run's result"
        assert len(files) == total - 1, f"expected a checkpoint after each of steps 1..{total - 1}, got {len(files)}"
        checked = []
        for index in files[:steps]:
            snap = read_snapshot(index)
            resumed, executed, metric = _final_latents(engine, request, CheckpointPlan(resume=snap))
            assert (executed, metric) == (total - snap.step, snap.step), (
                f"resuming at step {snap.step} executed {executed} steps (expected {total - snap.step})")
            assert _equal(resumed, plain), f"resumed from step {snap.step}: final latents differ from an " \
                                           "uninterrupted run"
            checked.append(snap.step)
    return checked
