"""Step checkpoints: one request's denoise state after ``k`` steps, on disk, so another process can go on from there.

Why: with several replicas on one job store, a replica that dies mid-job leaves its job to another one; with
``--checkpoint-every K`` that one resumes from the last checkpoint instead of step 0.

Who does what. A model whose ``ModelCapabilities.checkpointable`` is true gives its pipeline two methods:

- ``export_step_state(state, row) -> Mapping[str, Any]``: what the steps so far changed for request ``row`` of the
  batch (its latents rows, the sampler's history rows and counters, generator states if the sampler draws noise),
  as a nested structure of tensors, ``torch.Generator`` objects, JSON scalars, lists, tuples and ``str``-keyed dicts;
- ``import_step_state(state, saved) -> DenoiseState``: put it back into a fresh ``encode`` of that request alone.

Everything ``encode`` derives from the request (text embeddings, timestep grids, layouts) is recomputed on resume,
deterministically, and so is not saved. The core does the rest: :func:`pack` / :func:`unpack` turn the structure
into safetensors tensors plus a small JSON (exact bits: tensors keep their dtype, floats go through ``repr``), and
:func:`write_snapshot` / :func:`read_snapshot` put them on disk atomically.

Caches restart cold: a step cache's memory (TeaCache's accumulated distance, a first-block cache's residual, an
AdaLN table cursor) is not saved; a resumed batch starts its caches empty. A run without step caches resumes to
the same bits as an uninterrupted one; with a cache on, the resumed part may reuse different steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    import torch

    from .jobs import Job
    from .protocol import DenoiseState, Pipeline

logger = logging.getLogger("omnicore.engine")

FORMAT = "omnicore-step-checkpoint"
VERSION = 1


class StepStateError(ValueError):
    """A value in a model's exported step state that the core cannot write (names where it is), or a checkpoint
    file that cannot be read back (names the file and what is wrong)."""


@attrs.frozen
class StepSnapshot:
    """One request's denoise state after ``step`` completed steps of ``num_steps`` (``state``: the model's export)."""

    step: int
    num_steps: int
    model: str
    state: Mapping[str, Any]


@attrs.frozen
class CheckpointPlan:
    """What the engine does with one job's step state: ``save(snapshot)`` every ``every`` completed steps (on the
    worker thread; a failing save is logged and the job goes on), and ``resume`` (a snapshot to start from)."""

    every: int = 0
    save: Callable[[StepSnapshot], None] | None = None
    resume: StepSnapshot | None = None


def checkpointable(pipeline: Any) -> bool:
    """Whether ``pipeline``'s model declares checkpointable step state (and has the two methods)."""
    caps = getattr(getattr(pipeline, "spec", None), "capabilities", None)
    return bool(getattr(caps, "checkpointable", False)) and callable(getattr(pipeline, "export_step_state", None)) \
        and callable(getattr(pipeline, "import_step_state", None))


# ---------------------------------------------------------------------------------------------------- codec
def pack(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``state`` -> (tensors by key, a JSON-able tree with a ``{"__tensor__": key}`` where each tensor was).

    Tensors are copied to the CPU (contiguous, own storage, dtype kept); a ``torch.Generator`` becomes its state
    tensor plus its device. Anything else (an object, a non-string dict key) raises :class:`StepStateError`
    naming its path."""
    import torch

    tensors: dict[str, torch.Tensor] = {}

    def enc(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors[path] = value.detach().to("cpu", copy=True).contiguous()
            return {"__tensor__": path}
        if isinstance(value, torch.Generator):
            tensors[path] = value.get_state().clone()
            return {"__generator__": path, "device": str(value.device)}
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {"__float__": repr(value)}
        if isinstance(value, list):
            return [enc(v, f"{path}.{i}") for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {"__tuple__": [enc(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, Mapping):
            bad = [k for k in value if not isinstance(k, str)]
            if bad:
                raise StepStateError(f"step state at {path or '<root>'}: dict key {bad[0]!r} is not a string")
            return {"__dict__": {k: enc(v, f"{path}.{k}" if path else k) for k, v in value.items()}}
        raise StepStateError(f"step state at {path or '<root>'}: a {type(value).__name__} cannot be checkpointed "
                             "(tensors, generators, None, bool, int, float, str, list, tuple, dict only)")

    if not isinstance(state, Mapping):
        raise StepStateError(f"step state must be a mapping, got {type(state).__name__}")
    tree = enc(dict(state), "")
    return tensors, tree


def unpack(tensors: Mapping[str, torch.Tensor], tree: Any) -> Any:
    """The inverse of :func:`pack` (tensors stay where ``tensors`` has them; generators on their saved device)."""
    import torch

    def dec(node: Any) -> Any:
        if isinstance(node, list):
            return [dec(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "__tensor__" in node:
            return _tensor(tensors, node["__tensor__"])
        if "__generator__" in node:
            gen = torch.Generator(device=node.get("device", "cpu"))
            gen.set_state(_tensor(tensors, node["__generator__"]).cpu())
            return gen
        if "__float__" in node:
            return float(node["__float__"])
        if "__tuple__" in node:
            return tuple(dec(v) for v in node["__tuple__"])
        if "__dict__" in node:
            return {k: dec(v) for k, v in node["__dict__"].items()}
        raise StepStateError(f"step state: unknown node {sorted(node)!r}")

    return dec(tree)


def _tensor(tensors: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in tensors:
        raise StepStateError(f"step state: tensor {key!r} is missing from the checkpoint's tensors")
    return tensors[key]


# ---------------------------------------------------------------------------------------------------- files
def write_snapshot(snapshot: StepSnapshot, stem: Path) -> Path:
    """Write ``<stem>.safetensors`` (the tensors) then ``<stem>.json`` (the rest, the tensors' sha256), each to a
    temp file that is fsynced and renamed into place; returns the JSON's path (what a job record points at)."""
    from safetensors.torch import save_file

    tensors, tree = pack(snapshot.state)
    stem.parent.mkdir(parents=True, exist_ok=True)
    data = stem.with_name(stem.name + ".safetensors")
    _atomic(data, lambda tmp: save_file(tensors, str(tmp)) if tensors else tmp.write_bytes(b""))
    meta = {"format": FORMAT, "version": VERSION, "model": snapshot.model, "step": snapshot.step,
            "num_steps": snapshot.num_steps, "tensors": data.name if tensors else None,
            "sha256": _sha256(data) if tensors else None, "state": tree}
    index = stem.with_name(stem.name + ".json")
    _atomic(index, lambda tmp: tmp.write_text(json.dumps(meta, allow_nan=False)))
    if not tensors:
        data.unlink(missing_ok=True)
    return index


def read_snapshot(path: Path | str, device: str | None = None) -> StepSnapshot:
    """The snapshot whose JSON is at ``path`` (tensors loaded onto ``device``, default CPU). A missing, partial or
    foreign file raises :class:`StepStateError` naming it."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise StepStateError(f"step checkpoint {path}: cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise StepStateError(f"step checkpoint {path}: not an {FORMAT} v{VERSION} file")
    tensors: dict[str, Any] = {}
    if meta.get("tensors"):
        data = path.with_name(meta["tensors"])
        if not data.is_file() or _sha256(data) != meta.get("sha256"):
            raise StepStateError(f"step checkpoint {path}: its tensors file {data.name} is missing or does not "
                                 "match the recorded sha256")
        tensors = load_file(str(data), device=device or "cpu")
    return StepSnapshot(step=int(meta["step"]), num_steps=int(meta["num_steps"]), model=str(meta["model"]),
                        state=unpack(tensors, meta["state"]))


def snapshot_files(index: Path) -> list[Path]:
    """The files of the checkpoint whose JSON is ``index`` (for removal)."""
    return [index, index.with_name(index.name[: -len(".json")] + ".safetensors")]


def _atomic(final: Path, write: Callable[[Path], Any]) -> None:
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------------- the runner's side
def resume_point(pipeline: Pipeline, state: DenoiseState, members: Sequence[Job]) -> tuple[DenoiseState, int]:
    """After ``encode``: the state to start the steps from and its step. A batch with a resume snapshot holds that
    one job alone (the engine queues it under its own batch key); a snapshot this model or request cannot take
    (another model, another step count, a model without checkpointable state) is logged and ignored (step 0)."""
    plan = getattr(members[0], "checkpoint", None) if len(members) == 1 else None
    snap = plan.resume if plan is not None else None
    if snap is None:
        return state, 0
    job = members[0]
    model = getattr(pipeline.spec, "name", "")
    problem = ("the model declares no checkpointable step state" if not checkpointable(pipeline)
               else f"it was written by model {snap.model!r}, this is {model!r}" if snap.model != model
               else f"it is for {snap.num_steps} steps, this request has {state.num_steps}"
               if snap.num_steps != state.num_steps
               else f"its step {snap.step} is outside 1..{state.num_steps - 1}"
               if not 0 < snap.step < state.num_steps else None)
    if problem is not None:
        logger.warning("job %s: not resuming from its step checkpoint (%s); starting at step 0", job.id, problem)
        return state, 0
    restored = pipeline.import_step_state(state, snap.state)  # type: ignore[attr-defined]
    restored.step_index = snap.step
    job.metrics["resumed_from_step"] = float(snap.step)
    logger.info("job %s: resumed from its step checkpoint at step %d of %d", job.id, snap.step, snap.num_steps)
    return restored, snap.step


def save_due(pipeline: Pipeline, state: DenoiseState, members: Sequence[Job], done: int) -> None:
    """After step ``done`` (1-based): the jobs whose plan is due write their rows' snapshot (never after the last
    step: decode follows at once). A failing save is logged; the job goes on (it only loses resumability)."""
    if done >= state.num_steps or not checkpointable(pipeline):
        return
    for row, job in enumerate(members):
        plan = getattr(job, "checkpoint", None)
        if plan is None or plan.save is None or plan.every < 1 or done % plan.every or job.done:
            continue
        try:
            saved = pipeline.export_step_state(state, row)  # type: ignore[attr-defined]
            plan.save(StepSnapshot(step=done, num_steps=int(state.num_steps), model=pipeline.spec.name,
                                   state=saved))
        except Exception:
            logger.exception("job %s: step checkpoint at step %d failed; the job goes on without it", job.id, done)
