"""Failures over a tensor-parallel worker group (gloo, 2 processes, tiny MiniMax-H3): a rank killed mid-request
fails the request with an error naming the rank, the engine turns unhealthy and later requests fail fast; a
checkpoint whose DiT tensors do not match its config fails the load with an error naming the file, the tensor and
the ranks it failed on, and no worker process is left behind in either case."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from omnicore.engine.api import Engine, make_request
from omnicore.errors import OmnicoreError
from omnicore.parallel.group import WorkerGroupBroken

pytestmark = pytest.mark.slow
PARAMS = {"num_inference_steps": 30, "height": 64, "width": 64, "duration": 4.0, "extra": {"aspect_ratio": "1:1"}}


def _pids_gone(pids: list[int], wait_s: float = 20.0) -> bool:
    """No process with these ids runs (zombies count as gone), waiting up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.2)


def _children() -> set[int]:
    import os

    me = os.getpid()
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            try:
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"resource_tracker" not in cmdline:  # (multiprocessing's tracker lives as long as this process)
                found.add(int(stat.parent.name))
    return found


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
    assert _pids_gone([worker.pid])


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
    before = _children()
    with pytest.raises(OmnicoreError) as info:
        Engine(str(broken), parallel="tp=2").close()
    message = str(info.value)
    assert "shape mismatch" in message and "qkv_proj" in message and str(broken / "transformer") in message, message
    notes = " ".join(getattr(info.value, "__notes__", ()))
    assert "rank 0 of 2" in notes and "other ranks that failed: 1" in notes, notes  # every rank read the bad file
    assert _pids_gone(sorted(_children() - before)), "a worker outlived the failed load"
