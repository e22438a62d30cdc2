"""Failures and cancellation of HunyuanImage-3 over a worker group (gloo, 2 processes, the micro checkpoint):

* under ``tp=2`` and ``ep=2`` a request cancelled after its first step stops there on every rank, and the next
  request still equals the single-process image (the ranks stayed in step);
* under ``tp=2`` a rank killed mid-request fails the request with an error naming the rank, the engine turns
  unhealthy, later requests fail at once, and no worker outlives ``close()``;
* a checkpoint whose only bad tensor is an expert that rank 1 alone reads under ``ep=2`` fails the load with an
  error naming rank 1 and the tensor (rank 0 loaded fine: the worker-only branch of ``WorkerGroup.finish_load``);
* a real server over a 2-rank engine reports ``/health`` ok, each rank's startup peak RSS on ``/metrics``, and turns
  unhealthy (503, naming the rank) once a worker is killed.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _worker_group_helpers import child_pids, pids_gone
from omnicore.engine.api import Engine, make_request
from omnicore.errors import ConfigError
from omnicore.parallel.group import WorkerGroupBroken

pytestmark = pytest.mark.slow
PARAMS = {"height": 64, "width": 64, "num_inference_steps": 3, "guidance_scale": 4.0}
LONG = {**PARAMS, "num_inference_steps": 40}
PROMPT = "a lighthouse at dusk"


@pytest.fixture(scope="module")
def reference(micro_dir: Path) -> np.ndarray:
    with Engine(str(micro_dir)) as engine:
        return engine.submit(make_request(PROMPT, seed=7, **PARAMS)).result(600)[0].frames


def _cancel_after_first_step(engine: Engine) -> list[int]:
    """Submit a long request, cancel it once its first step ran; returns the steps it reported."""
    steps: list[int] = []
    job = None

    def on_event(event: Any) -> None:
        if event.phase == "denoise":
            steps.append(event.step)
            if job is not None and event.step >= 1:
                job.cancel()
    job = engine.submit(make_request("a red fox in the snow", seed=3, **LONG), on_event=on_event)
    assert job.wait(300), "a cancelled request over the worker group hung"
    assert job.status == "cancelled", (job.status, job.error)
    return steps


def _same(got: np.ndarray, expected: np.ndarray) -> None:
    assert got.shape == expected.shape
    assert np.abs(got.astype(int) - expected.astype(int)).max() <= 1  # fp32 reassociation: one uint8 level


@pytest.mark.parametrize("parallel", ["tp=2", "ep=2"])
def test_a_request_cancelled_mid_run_stops_and_the_ranks_stay_in_step(micro_dir: Path, reference: np.ndarray,
                                                                     parallel: str) -> None:
    engine = Engine(str(micro_dir), parallel=parallel)
    pids = [p.pid for p in engine.group.processes]
    try:
        # every rank reported its host memory when its load ended (the startup peak bounds what it holds now)
        assert len(engine.load_memory) == 2
        for memory in engine.load_memory:
            assert memory is not None and memory.peak_rss_bytes and memory.rss_bytes
            assert memory.peak_rss_bytes >= memory.rss_bytes > 0
        steps = _cancel_after_first_step(engine)
        assert steps and max(steps) < LONG["num_inference_steps"] - 1, steps  # stopped long before the end
        assert engine.stats()["jobs_cancelled"] == 1 and engine.worker_alive
        _same(engine.submit(make_request(PROMPT, seed=7, **PARAMS)).result(600)[0].frames, reference)
    finally:
        assert engine.close(timeout=120)
    assert pids_gone(pids)


def test_a_rank_killed_mid_request_fails_it_naming_the_rank(micro_dir: Path) -> None:
    engine = Engine(str(micro_dir), parallel="tp=2")
    worker = engine.group.processes[0]
    killed = threading.Event()

    def kill_on_first_step(event: Any) -> None:
        if event.phase == "denoise" and not killed.is_set():
            killed.set()
            worker.kill()
    try:
        job = engine.submit(make_request(PROMPT, seed=1, **LONG), on_event=kill_on_first_step)
        assert job.wait(180), "the request hung after a tensor-parallel rank died"
        assert job.status == "failed" and isinstance(job.error, WorkerGroupBroken)
        assert "worker rank 1" in str(job.error), str(job.error)
        assert not engine.worker_alive and "worker rank 1" in (engine.worker_failure or "")
        later = engine.submit(make_request("a dog", seed=2, **PARAMS))
        assert later.wait(60) and isinstance(later.error, WorkerGroupBroken)
    finally:
        assert engine.close(timeout=60)
    assert pids_gone([worker.pid])


def test_a_bad_expert_only_rank_1_reads_fails_the_load_naming_rank_1(micro_dir: Path, tmp_path: Path) -> None:
    """Under ep=2 rank 0 never reads the last expert (rank 1's half): a wrong shape there fails rank 1 alone."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(micro_dir, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    experts = json.loads((broken / "config.json").read_text())["num_experts"]
    name = next(k for k in sorted(index["weight_map"])
                if re.fullmatch(rf"model\.layers\.\d+\.mlp\.experts\.{experts - 1}\.down_proj\.weight", k))
    file = broken / index["weight_map"][name]
    state = load_file(str(file))
    state[name] = torch.zeros(state[name].shape[0] + 1, state[name].shape[1])
    save_file(state, str(file), metadata={"format": "pt"})
    before = child_pids()
    with pytest.raises(ConfigError) as info:
        Engine(str(broken), parallel="ep=2").close()
    message = str(info.value)
    assert "rank 1 failed to load the model" in message and "CheckpointError" in message, message
    assert name in message, message
    assert pids_gone(sorted(child_pids() - before)), "a worker outlived the failed load"


def test_the_server_turns_unhealthy_when_a_rank_dies(micro_dir: Path, tmp_path: Path) -> None:
    import httpx
    from _server_helpers import LiveServer
    from omnicore.server import ServerSettings, create_app

    engine = Engine(str(micro_dir), parallel="tp=2")
    worker = engine.group.processes[0]
    server = LiveServer(create_app(engine, ServerSettings(state_dir=tmp_path / "state"),
                                   model_arg=str(micro_dir))).start()
    try:
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        for rank in (0, 1):  # each rank's startup peak, as the ranks reported it
            peak = re.search(rf'omnicore_load_peak_rss_bytes{{rank="{rank}"}} (\S+)', metrics)
            expected = engine.load_memory[rank]
            assert peak and expected is not None and float(peak.group(1)) == expected.peak_rss_bytes, metrics
        worker.kill()
        deadline = time.monotonic() + 60
        while True:
            health = httpx.get(server.url + "/health", timeout=30)
            if health.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert health.status_code == 503, health.text
        body = health.json()
        assert body["status"] == "unhealthy" and "worker rank 1" in body.get("error", ""), body
    finally:
        server.stop()
    assert pids_gone([worker.pid])
