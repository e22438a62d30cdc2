"""Failures over a tensor-parallel worker group (gloo, 2 processes, tiny MiniMax-H3): a rank killed mid-request
fails the request with an error naming the rank, the engine turns unhealthy and later requests fail fast; a
checkpoint whose DiT tensors do not match its config fails the load with an error naming the file, the tensor and
the ranks it failed on, and no worker process is left behind in either case."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
from _worker_group_helpers import child_pids, pids_gone
from omnicore.engine.api import Engine, make_request
from omnicore.errors import OmnicoreError
from omnicore.parallel.group import WorkerGroupBroken

pytestmark = pytest.mark.slow
PARAMS = {"num_inference_steps": 30, "height": 64, "width": 64, "duration": 4.0, "extra": {"aspect_ratio": "1:1"}}


def test_a_rank_killed_mid_request_fails_it_naming_the_rank(tiny_dir: Path) -> None:
    engine = Engine(str(tiny_dir), parallel="tp=2")
    worker = engine.group.processes[0]
    killed = threading.Event()

    def kill_on_first_step(event: Any) -> None:
        if event.phase == "denoise" and not killed.is_set():
            killed.set()
            worker.kill()
    try:
        job = engine.submit(make_request("rain on a tin roof", seed=1, **PARAMS), on_event=kill_on_first_step)
        assert job.wait(180), "the request hung after a tensor-parallel rank died"
        assert job.status == "failed" and isinstance(job.error, WorkerGroupBroken)
        assert "worker rank 1" in str(job.error), str(job.error)
        assert not engine.worker_alive and engine.worker_failure is not None
        later = engine.submit(make_request("a dog barking", seed=2, **{**PARAMS, "num_inference_steps": 2}))
        assert later.wait(60) and isinstance(later.error, WorkerGroupBroken)
    finally:
        assert engine.close(timeout=60)
    assert pids_gone([worker.pid])


def test_a_checkpoint_that_does_not_match_its_config_fails_the_load_clearly(tiny_dir: Path,
                                                                            tmp_path: Path) -> None:
    """One DiT tensor has the wrong shape for the config (a wrong shard file): each rank narrows its slice from
    the header before reading, so the load fails with the tensor's name instead of a shape error mid-forward."""
    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    file = broken / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(file))
    name = next(k for k in sorted(state) if k.endswith("weight") and state[k].ndim == 2 and "attn" in k)
    state[name] = torch.zeros(state[name].shape[0] + 2, state[name].shape[1])
    save_file(state, str(file))
    before = child_pids()
    with pytest.raises(OmnicoreError) as info:
        Engine(str(broken), parallel="tp=2").close()
    message = str(info.value)
    assert "shape mismatch" in message and "qkv_proj" in message and str(broken / "transformer") in message, message
    notes = " ".join(getattr(info.value, "__notes__", ()))
    assert "rank 0 of 2" in notes and "other ranks that failed: 1" in notes, notes  # every rank read the bad file
    assert pids_gone(sorted(child_pids() - before)), "a worker outlived the failed load"
