"""A rank failing where the others may wait in a collective (gloo, 2 processes, tiny MiniMax-H3 under ``tp=2``,
whose Qwen3-VL text encoder all-reduces twice per layer during the encode): the request fails within seconds, not
at the process group's timeout, with an error naming the rank.

* A failure every rank shares (the same fault inside the text encoder on both ranks) fails that request only:
  the ranks exchange how their encode ended, and the group stays in step (the next request's frames equal the
  same request's before the failure).
* Rank 1 alone failing inside the text encoder (rank 0 then waits in layer 1's MLP all-reduce), or rank 0 alone
  (rank 1 waits there): the ranks are out of step, the group is ended (``omnicore.parallel.lockstep``), the
  engine turns unhealthy naming the rank, its phase and its error, and no worker outlives the engine.
* Rank 1 alone failing inside denoise step 1: the same, the error naming the step.

Faults are injected by ``_h3_faults`` (rank 0 on the engine's pipeline, the worker through
``_worker_group_helpers.at_worker_start``); the hang guards (``wait(120)``) are far above the
``RankSpec.out_of_step_s`` (10 s) the out-of-step cases take.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _h3_faults import ENCODE_MARK, FAULT_STEP, STEP_MARK, InjectedFault, clear_encode, inject_encode
from _worker_group_helpers import at_worker_start, pids_gone
from omnicore.engine.api import Engine, make_request
from omnicore.parallel.group import WorkerGroupBroken

pytestmark = pytest.mark.slow
PARAMS: dict[str, Any] = {"num_inference_steps": 2, "height": 64, "width": 64, "duration": 4.0,
                          "extra": {"aspect_ratio": "1:1"}}
HANG_GUARD_S = 120


def _engine(tmp_path: Path, tiny_dir: Path, phases: str) -> Engine:
    with at_worker_start(tmp_path, "_h3_faults:install_from_environment", H3_TEST_FAULT=phases):
        return Engine(str(tiny_dir), parallel="tp=2")


def _failed(engine: Engine, prompt: str, seed: int = 3) -> Any:
    job = engine.submit(make_request(prompt, seed=seed, **PARAMS))
    assert job.wait(HANG_GUARD_S), "the request hung"
    assert job.status == "failed", job.status
    return job.error


def _broken_then_closed(engine: Engine, error: BaseException, *needles: str) -> None:
    """The request's error and the engine's health name the failure; later requests fail at once; closing the
    engine leaves no worker behind."""
    worker = engine.group.processes[0]
    try:
        assert isinstance(error, WorkerGroupBroken), repr(error)
        for needle in needles:
            assert needle in str(error), str(error)
        assert not engine.worker_alive and engine.worker_failure is not None
        assert all(needle in engine.worker_failure for needle in needles), engine.worker_failure
        later = engine.submit(make_request("a dog barking", seed=2, **PARAMS))
        assert later.wait(30) and isinstance(later.error, WorkerGroupBroken)
    finally:
        assert engine.close(timeout=60)
    assert pids_gone([worker.pid])


def test_a_shared_encode_failure_fails_the_request_and_a_rank1_only_one_ends_the_group(tiny_dir: Path,
                                                                                       tmp_path: Path) -> None:
    engine = _engine(tmp_path, tiny_dir, "encode")
    try:
        before = engine.submit(make_request("rain on a tin roof", seed=3, **PARAMS)).result(HANG_GUARD_S)

        inject_encode(engine.pipeline)  # both ranks fail at the same point: an in-step failure
        error = _failed(engine, f"rain on a tin roof {ENCODE_MARK}")
        assert isinstance(error, InjectedFault) and "on rank 0" in str(error), repr(error)
        notes = " ".join(getattr(error, "__notes__", ()))
        assert "rank 0 of 2 in the encode" in notes and "other ranks that failed: 1" in notes, notes
        assert engine.worker_alive and engine.worker_failure is None
        clear_encode(engine.pipeline)
        after = engine.submit(make_request("rain on a tin roof", seed=3, **PARAMS)).result(HANG_GUARD_S)
        assert np.array_equal(after[0].frames, before[0].frames)  # the ranks are still in step

        error = _failed(engine, f"thunder {ENCODE_MARK}")  # rank 1 alone: rank 0 waits in an all-reduce
    except BaseException:
        engine.close(timeout=60)
        raise
    _broken_then_closed(engine, error, "worker rank 1", "failed in the encode",
                        "injected fault in the text encoder on rank 1", "out of step")


def test_rank0_failing_alone_inside_the_encode_ends_the_group(tiny_dir: Path, tmp_path: Path) -> None:
    engine = _engine(tmp_path, tiny_dir, "")
    try:
        inject_encode(engine.pipeline)
        error = _failed(engine, f"thunder {ENCODE_MARK}")  # rank 1 waits in layer 1's MLP all-reduce
    except BaseException:
        engine.close(timeout=60)
        raise
    assert isinstance(error.__cause__, InjectedFault), repr(error.__cause__)
    _broken_then_closed(engine, error, "rank 0 failed in the encode", "injected fault in the text encoder on rank 0",
                        "out of step")


def test_rank1_failing_inside_a_denoise_step_names_the_rank_the_step_and_the_error(tiny_dir: Path,
                                                                                    tmp_path: Path) -> None:
    engine = _engine(tmp_path, tiny_dir, "step")
    try:
        error = _failed(engine, f"thunder {STEP_MARK}")  # rank 0 waits in block 1's all-reduce
    except BaseException:
        engine.close(timeout=60)
        raise
    _broken_then_closed(engine, error, "worker rank 1", f"failed in denoise step {FAULT_STEP}",
                        f"injected fault in denoise step {FAULT_STEP} on rank 1")
