"""LingBot over a worker group (``--parallel``, gloo, 2-4 processes): outputs equal to the single-process engine
(same seeds) for Ulysses and CFG-parallel, single requests and batches; cancellation between steps (also of one
request of a running batch); a killed worker fails its request with a clear error; close() leaves no process."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _worker_group_helpers import pids_gone
from omnicore.engine.api import Engine, make_request
from omnicore.errors import ConfigError
from omnicore.parallel.group import WorkerGroupBroken

SMALL = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2}
PROMPTS = ("a red fox", "a blue bird in the snow")


def test_head_count_the_ulysses_degree_does_not_divide_is_refused_at_load(pipe: Any) -> None:
    heads = pipe.transformer.config.num_attention_heads  # 2 in the tiny preset
    with pytest.raises(ConfigError, match=rf"ulysses=3 must divide the model's attention heads \({heads}\)"):
        pipe.transformer.enable_ulysses(SimpleNamespace(ulysses=3))
    assert pipe.transformer.sequence_parallel is None


def _engine(path: Path, parallel: str | None = None) -> Engine:
    from omnicore.plugin_host.host import default_host

    settings = default_host().settings.evolve(request_batch_max_wait_ms=400.0)  # lets two submits form a batch
    return Engine(str(path), settings=settings, parallel=parallel)


def _frames(engine: Engine, *prompts: str, guidance: float = 3.0, seed: int = 11) -> list[np.ndarray]:
    """One output per prompt, submitted together so they run as one batch (checked)."""
    jobs = [engine.submit(make_request(p, guidance_scale=guidance, seed=seed + i, **SMALL))
            for i, p in enumerate(prompts)]
    outputs = [job.result(600)[0] for job in jobs]
    assert {o.metrics["batch_requests"] for o in outputs} == {len(prompts)}
    return [o.frames for o in outputs]


def _assert_same(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        # uint8 after decode: fp32 reassociation may move a value across a rounding boundary, never further
        assert np.abs(g.astype(int) - e.astype(int)).max() <= 1


@pytest.fixture(scope="module")
def reference(tiny_dir: Path) -> dict[str, list[np.ndarray]]:
    with _engine(tiny_dir) as engine:
        return {"single": _frames(engine, PROMPTS[0]), "batch": _frames(engine, *PROMPTS),
                "unguided": _frames(engine, *PROMPTS, "a green frog", guidance=1.0)}


@pytest.mark.slow
def test_ulysses_matches_single_process_and_cancels_between_steps(tiny_dir: Path, reference: Any) -> None:
    engine = _engine(tiny_dir, "ulysses=2")
    pids = [p.pid for p in engine.group.processes]
    try:
        assert engine.pipeline.transformer.sequence_parallel.ulysses == 2
        _assert_same(_frames(engine, PROMPTS[0]), reference["single"])
        _assert_same(_frames(engine, *PROMPTS), reference["batch"])
        # cancel one request of a running batch after its first step: the batch shrinks on every rank
        jobs = [engine.submit(make_request(p, guidance_scale=3.0, seed=11 + i, **{**SMALL, "num_inference_steps": 4}))
                for i, p in enumerate(PROMPTS)]

        def cancel_second(event: Any) -> None:
            if event.phase == "denoise" and event.step == 1:
                jobs[1].cancel()
        jobs[1].add_listener(cancel_second)
        jobs[0].result(600)
        assert jobs[1].wait(600) and jobs[1].status == "cancelled"
        assert engine.stats()["jobs_cancelled"] == 1
        _assert_same(_frames(engine, PROMPTS[0]), reference["single"])  # the ranks are still in lockstep
    finally:
        assert engine.close(timeout=120)
    assert pids_gone(pids)  # no orphans
    import torch.distributed as dist

    assert not dist.is_initialized()


@pytest.mark.slow
def test_cfg_parallel_matches_single_process_guided_and_unguided(tiny_dir: Path, reference: Any) -> None:
    with _engine(tiny_dir, "cfg=2") as engine:
        pids = [p.pid for p in engine.group.processes]
        _assert_same(_frames(engine, PROMPTS[0]), reference["single"])
        _assert_same(_frames(engine, *PROMPTS), reference["batch"])
        before = engine.group.ctx.stats.snapshot()["calls"].get("all_gather", 0)
        # guidance off: the CFG ranks split the batch of 3 (2 + 1 rows) and gather it back
        _assert_same(_frames(engine, *PROMPTS, "a green frog", guidance=1.0), reference["unguided"])
        assert engine.group.ctx.stats.snapshot()["calls"]["all_gather"] == before + SMALL["num_inference_steps"]
    assert pids_gone(pids)


@pytest.mark.slow
def test_cfg_times_ulysses_on_four_processes(tiny_dir: Path, reference: Any) -> None:
    with _engine(tiny_dir, "cfg=2,ulysses=2") as engine:
        assert len(engine.group.processes) == 3
        _assert_same(_frames(engine, *PROMPTS), reference["batch"])


@pytest.mark.slow
def test_killed_worker_fails_the_request_clearly_and_the_engine_turns_unhealthy(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, "cfg=2")
    worker = engine.group.processes[0]
    killed = threading.Event()

    def kill_on_first_step(event: Any) -> None:
        if event.phase == "denoise" and not killed.is_set():
            killed.set()
            worker.kill()
    try:
        job = engine.submit(make_request(PROMPTS[0], guidance_scale=3.0, seed=1,
                                         **{**SMALL, "num_inference_steps": 30}), on_event=kill_on_first_step)
        assert job.wait(120), "the request hung after its worker died"
        assert job.status == "failed"
        assert isinstance(job.error, WorkerGroupBroken)
        assert "worker rank 1" in str(job.error) and "exited" in str(job.error)
        assert not engine.worker_alive  # the server reports unhealthy, with this reason
        assert engine.worker_failure is not None and "worker rank 1" in engine.worker_failure
        later = engine.submit(make_request(PROMPTS[1], guidance_scale=3.0, seed=2, **SMALL))
        assert later.wait(60) and isinstance(later.error, WorkerGroupBroken)
    finally:
        assert engine.close(timeout=60)
    assert pids_gone([worker.pid])


@pytest.mark.slow
def test_workers_exit_when_the_engine_process_is_killed(tiny_dir: Path, tmp_path: Path) -> None:
    script = tmp_path / "hold.py"
    script.write_text(
        "import time\n"
        "from omnicore.engine.api import Engine\n"
        "if __name__ == '__main__':\n"
        f"    engine = Engine({str(tiny_dir)!r}, parallel='ulysses=2')\n"
        "    print(*[p.pid for p in engine.group.processes], flush=True)\n"
        "    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in holder.stdout.readline().split()]  # type: ignore[union-attr]
        assert len(pids) == 1
    finally:
        holder.kill()  # SIGKILL: no atexit, no close(); the workers must notice on their own
        holder.wait(30)
    deadline = time.monotonic() + 20
    while not pids_gone(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert pids_gone(pids), "a worker outlived the engine's process"


@pytest.mark.slow
def test_rank0_failing_mid_step_ends_the_group_instead_of_hanging(tiny_dir: Path) -> None:
    engine = _engine(tiny_dir, "cfg=2")
    worker = engine.group.processes[0]
    model = engine.pipeline.transformer  # rank 0's copy only: the worker's forward still enters the exchange
    calls = {"n": 0}
    forward = model.forward

    def failing_forward(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # step 1: rank 0 never reaches the CFG exchange the worker waits in
            raise RuntimeError("rank-0 boom")
        return forward(*args, **kwargs)
    model.forward = failing_forward
    try:
        job = engine.submit(make_request(PROMPTS[0], guidance_scale=3.0, seed=1, **{**SMALL, "num_inference_steps": 4}))
        assert job.wait(60), "the request hung"
        assert job.status == "failed" and "rank-0 boom" in str(job.error)  # the real cause, not a transport error
        assert not engine.worker_alive
        assert "denoise step 1" in engine.group.failure
    finally:
        assert engine.close(timeout=60)
    assert pids_gone([worker.pid])
