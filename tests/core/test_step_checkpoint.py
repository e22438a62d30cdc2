"""Step checkpoints (omnicore.engine.step_checkpoint): the codec is exact, the files are checked, and the engine
saves every K steps and resumes from a snapshot (toy model: the resumed job runs only the remaining steps and ends
with the same latents, bit for bit, as the uninterrupted run)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from omnicore.engine.step_checkpoint import (
    CheckpointPlan,
    StepSnapshot,
    StepStateError,
    pack,
    read_snapshot,
    snapshot_files,
    unpack,
    write_snapshot,
)


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    torch.randn(3, generator=gen)  # advance it: a state that is not the seed's start
    return {
        "latents": torch.randn(2, 3, 4, dtype=torch.float32),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "index": torch.arange(4, dtype=torch.int64)[1::2],  # a strided view: written contiguous
        "scalar": torch.tensor(981.0),
        "history": [None, torch.randn(1, 2), None],
        "pair": (torch.zeros(0), 3),
        "counters": {"lower_order_nums": 2, "this_order": 1, "phase": "base", "flag": True, "none": None},
        "floats": [0.1, 1e-300, -0.0, math.inf, -math.inf],
        "generator": gen,
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, torch.Generator):
        return isinstance(b, torch.Generator) and torch.equal(a.get_state(), b.get_state())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return isinstance(b, float) and (a == b and math.copysign(1, a) == math.copysign(1, b))
    return type(a) is type(b) and a == b


def test_pack_and_unpack_keep_every_bit_and_type() -> None:
    state = _state()
    tensors, tree = pack(state)
    json.dumps(tree, allow_nan=False)  # the non-tensor part is plain JSON (infinities encoded, not NaN literals)
    back = unpack(tensors, tree)
    assert _same(state, back)
    # a restored generator goes on drawing exactly what the original would
    assert torch.equal(torch.randn(4, generator=state["generator"]), torch.randn(4, generator=back["generator"]))


def test_a_packed_tensor_is_a_copy_not_a_view() -> None:
    latents = torch.zeros(3)
    tensors, tree = pack({"latents": latents})
    latents += 1  # the next step writes in place
    assert torch.equal(unpack(tensors, tree)["latents"], torch.zeros(3))


@pytest.mark.parametrize(("state", "where"), [
    ({"sampler": object()}, "sampler"),
    ({"rows": [1, {"x": {1, 2}}]}, "rows.1.x"),
    ({"by_index": {0: torch.zeros(1)}}, "by_index"),
])
def test_values_the_codec_cannot_write_are_named(state: dict[str, Any], where: str) -> None:
    with pytest.raises(StepStateError, match=f"at {where}"):
        pack(state)


def test_files_round_trip_and_hold_what_they_say(tmp_path: Path) -> None:
    snap = StepSnapshot(step=3, num_steps=8, model="toy", state=_state())
    index = write_snapshot(snap, tmp_path / "job.1.3")
    assert [p.name for p in snapshot_files(index)] == ["job.1.3.json", "job.1.3.safetensors"]
    meta = json.loads(index.read_text())
    assert (meta["step"], meta["num_steps"], meta["model"], meta["tensors"]) == (3, 8, "toy", "job.1.3.safetensors")
    back = read_snapshot(index)
    assert (back.step, back.num_steps, back.model) == (3, 8, "toy") and _same(snap.state, back.state)
    assert not list(tmp_path.glob(".*"))  # no temp file left


def test_a_damaged_or_foreign_checkpoint_is_refused_with_its_name(tmp_path: Path) -> None:
    index = write_snapshot(StepSnapshot(1, 4, "toy", {"x": torch.ones(2)}), tmp_path / "j.1.1")
    data = snapshot_files(index)[1]
    data.write_bytes(data.read_bytes()[:-1] + b"\x00")
    with pytest.raises(StepStateError, match="j.1.1.safetensors.*sha256"):
        read_snapshot(index)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(StepStateError, match="other.json: not an omnicore-step-checkpoint"):
        read_snapshot(other)
    with pytest.raises(StepStateError, match="missing.json: cannot be read"):
        read_snapshot(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from toy import toy_engine

    eng = toy_engine(tmp_path_factory.mktemp("toy-ckpt"), max_num_seqs=1)
    final: dict[str, torch.Tensor] = {}
    decode = eng.pipeline.decode

    def recording_decode(state: Any) -> Any:  # the final latents of each request, by prompt
        for i, r in enumerate(state.requests):
            final[r.prompt] = state.latents[i:i + 1].clone()
        return decode(state)

    eng.pipeline.decode = recording_decode
    eng.final = final
    yield eng
    eng.close()


def _run(engine: Any, prompt: str, plan: CheckpointPlan | None = None,
         steps: int = 4) -> tuple[torch.Tensor, int, float]:
    """(final latents, steps the engine executed, the output's ``resumed_from_step`` metric or 0)."""
    from omnicore.engine.api import make_request

    before = engine.stats()["steps_executed"]
    job = engine.submit(make_request(prompt, seed=11, num_inference_steps=steps),
                        checkpoint=plan)
    out = job.result(60)
    return engine.final[prompt], engine.stats()["steps_executed"] - before, out[0].metrics.get("resumed_from_step", 0)


def test_the_engine_saves_every_k_steps_and_resumes_to_the_same_bits(engine: Any, tmp_path: Path) -> None:
    plain, executed, _ = _run(engine, "a lighthouse")
    assert executed == 4
    saved: list[Path] = []
    plan = CheckpointPlan(every=2, save=lambda s: saved.append(write_snapshot(s, tmp_path / f"s{s.step}")))
    with_saves, _, _ = _run(engine, "a lighthouse", plan, steps=5)
    assert [p.name for p in saved] == ["s2.json", "s4.json"]  # every 2 steps, never after the last one
    saved.clear()
    with_saves, _, _ = _run(engine, "a lighthouse", CheckpointPlan(every=1, save=lambda s: saved.append(
        write_snapshot(s, tmp_path / f"t{s.step}"))))
    assert torch.equal(with_saves, plain)  # saving does not disturb the run
    snap = read_snapshot(saved[1])
    resumed, executed, metric = _run(engine, "a lighthouse", CheckpointPlan(resume=snap))
    assert (snap.step, executed, metric) == (2, 2, 2.0)  # it started at the checkpoint's step
    assert torch.equal(resumed, plain)
    # the test can fail: a snapshot of other latents gives other bits
    bent = StepSnapshot(snap.step, snap.num_steps, snap.model, {"latents": snap.state["latents"] + 1e-3})
    assert not torch.equal(_run(engine, "a lighthouse", CheckpointPlan(resume=bent))[0], plain)


def test_a_snapshot_the_request_cannot_take_is_ignored(engine: Any) -> None:
    saved: list[StepSnapshot] = []
    _run(engine, "a harbour", CheckpointPlan(every=2, save=saved.append))
    plain, _, _ = _run(engine, "a harbour", steps=5)
    # written for 4 steps: a 5-step request starts at step 0 (and ends as an uninterrupted run does)
    resumed, executed, metric = _run(engine, "a harbour", CheckpointPlan(resume=saved[0]), steps=5)
    assert (executed, metric) == (5, 0) and torch.equal(resumed, plain)
    foreign = StepSnapshot(saved[0].step, saved[0].num_steps, "another-model", saved[0].state)
    assert _run(engine, "a harbour", CheckpointPlan(resume=foreign))[1:] == (4, 0)


def test_a_failing_save_does_not_fail_the_job(engine: Any) -> None:
    def broken(snapshot: StepSnapshot) -> None:
        raise OSError("disk full")

    plain, _, _ = _run(engine, "a quay")
    out, executed, _ = _run(engine, "a quay", CheckpointPlan(every=1, save=broken))
    assert executed == 4 and torch.equal(out, plain)
