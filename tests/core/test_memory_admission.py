"""Memory admission: a request the placement cannot hold is refused before it runs, on every surface (Python's
typed error, HTTP 400 for images and video jobs, a one-line CLI error), priced by the planner; CPU engines are
not checked unless a limit is given."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("omni_lingbot", reason="the LingBot plugin (plugins/lingbot) is not installed")

from omnicore.config import Settings  # noqa: E402
from omnicore.engine.api import Engine  # noqa: E402
from omnicore.engine.limits import MemoryLimitExceeded  # noqa: E402
from omnicore.engine.request import GenerationRequest, SamplingParams  # noqa: E402
from omnicore.plugin_host.host import PluginHost  # noqa: E402

SMALL = {"height": 48, "width": 48, "num_frames": 1, "num_inference_steps": 1}
BIG = {"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 1}


def _request(fields: dict[str, Any]) -> GenerationRequest:
    return GenerationRequest("a fox", params=SamplingParams(**fields))


@pytest.fixture(scope="module")
def sized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The planner's per-rank estimates of SMALL and BIG on tiny:lingbot (float32, one CPU rank), and a limit
    between them (so the numbers below come from the planner, not from this file)."""
    from omnicore.engine.loading import resolve_model
    from omnicore.planning.admission import build_guard
    from omnicore.platforms.cpu import CpuPlatform

    root = tmp_path_factory.mktemp("admission")
    settings = Settings(cache_dir=str(root / "cache"), plugins=("lingbot",))
    host = PluginHost(settings)
    resolved = resolve_model("tiny:lingbot", host, settings)
    guard = build_guard(resolved.spec, resolved.path, platform=CpuPlatform(), dtype=torch.float32,
                        device_memory_gib=1024.0)
    assert guard is not None
    small, big = guard.estimate(_request(SMALL)), guard.estimate(_request(BIG))
    assert small is not None and big is not None and small.total < big.total
    limit_gib = (small.total + big.total) / 2 / 2**30
    return {"settings": settings, "host": host, "small": small, "big": big, "limit_gib": limit_gib,
            "root": root}


@pytest.fixture(scope="module")
def engine(sized: dict[str, Any]) -> Any:
    with Engine("tiny:lingbot", host=sized["host"], settings=sized["settings"],
                device_memory=sized["limit_gib"]) as eng:
        yield eng


def test_python_refuses_a_request_over_the_limit_before_it_runs(engine: Any, sized: dict[str, Any]) -> None:
    """A typed ``MemoryLimitExceeded`` naming the estimate, the limit and the placement; the job never queues;
    a request under the limit generates."""
    before = engine.stats()
    with pytest.raises(MemoryLimitExceeded) as err:
        engine.submit(_request(BIG))
    exc = err.value
    assert exc.code == "memory_limit_exceeded" and exc.limit == "device_memory" and exc.placement == "single"
    assert exc.estimate_bytes == sized["big"].total > exc.limit_bytes
    assert exc.limit_bytes == int(sized["limit_gib"] * 2**30)
    assert "per rank on single" in str(exc) and "--device-memory" in str(exc)
    assert engine.stats().get("completed", 0) == before.get("completed", 0)
    outputs = engine.generate("a fox", **SMALL, seed=0)
    assert len(outputs) == 1


def test_estimate_is_the_planners_and_is_cheap(engine: Any, sized: dict[str, Any]) -> None:
    """The guard's estimate is the plan's single row for the same request (weights, activations, caches), and
    sizing a request builds no module."""
    from omnicore.cli.plan_cmd import build_plan

    plan = build_plan("tiny:lingbot", request=BIG | {"prompt": "a fox"}, dtype="float32", host=sized["host"],
                      settings=sized["settings"])
    row = next(p for p in plan.placements if p.name == "single")
    est = engine.memory_guard.estimate(_request(BIG))
    assert est.resident == sum(row.weights.values())  # no reserve on a CPU "device"
    assert est.activations == row.activations and est.caches == sum(row.caches.values())

    built = []
    original = torch.nn.Module.__init__

    def counting(self: Any, *a: Any, **k: Any) -> None:
        built.append(type(self).__name__)
        original(self, *a, **k)

    torch.nn.Module.__init__ = counting  # type: ignore[method-assign]
    try:
        start = time.perf_counter()
        for _ in range(20):
            engine.memory_guard.estimate(_request(BIG))
        elapsed = (time.perf_counter() - start) / 20
    finally:
        torch.nn.Module.__init__ = original  # type: ignore[method-assign]
    assert built == [] and elapsed < 0.05


def test_cpu_engines_are_not_checked_by_default(sized: dict[str, Any]) -> None:
    """No limit given on CPU: no guard at all (a tiny preset is never refused for memory); ``0`` turns it off."""
    from omnicore.engine.loading import resolve_model
    from omnicore.planning.admission import build_guard
    from omnicore.platforms.cpu import CpuPlatform

    resolved = resolve_model("tiny:lingbot", sized["host"], sized["settings"])
    for limit in (None, 0.0):
        assert build_guard(resolved.spec, resolved.path, platform=CpuPlatform(), dtype=torch.float32,
                           device_memory_gib=limit) is None


def test_weights_over_the_limit_are_refused_before_loading(sized: dict[str, Any]) -> None:
    with pytest.raises(MemoryLimitExceeded) as err:
        Engine("tiny:lingbot", host=sized["host"], settings=sized["settings"],
               device_memory=sized["small"].resident / 2 / 2**30)
    assert err.value.field == "device_memory" and "before any request" in str(err.value)


def test_http_images_and_video_jobs_answer_400(engine: Any, sized: dict[str, Any]) -> None:
    """Both endpoints: 400 ``memory_limit_exceeded`` naming the estimate and the limit; no job is stored."""
    import httpx
    from _server_helpers import LiveServer
    from omnicore.server import ServerSettings, create_app

    srv = LiveServer(create_app(engine, ServerSettings(state_dir=sized["root"] / "state"),
                                model_arg="tiny:lingbot")).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            r = client.post("/v1/images/generations", json={"model": "lingbot", "prompt": "a fox", "size": "48x48",
                                                            "num_inference_steps": 1})
            assert r.status_code == 200, r.text  # a small image fits
            r = client.post("/v1/images/generations", json={"model": "lingbot", "prompt": "a fox",
                                                            "size": "1024x1024", "num_inference_steps": 1})
            assert r.status_code == 400 and r.json()["error"]["code"] == "memory_limit_exceeded", r.text
            r = client.post("/v1/videos", json={"model": "lingbot", "prompt": "a fox", "size": "1024x1024",
                                                "num_frames": 17, "num_inference_steps": 1})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["code"] == "memory_limit_exceeded"
            assert "per rank" in err["message"] and "more than the limit" in err["message"]
            assert client.get("/v1/videos").json()["data"] == []
    finally:
        srv.stop()


@pytest.mark.slow
def test_cli_generate_prints_one_line(sized: dict[str, Any], tmp_path: Path) -> None:
    env = {**os.environ, "OMNICORE_CACHE": str(sized["root"] / "cache")}
    argv = [str(Path(sys.executable).parent / "omnicore"), "generate", "tiny:lingbot", "a fox", "--height", "1024",
            "--width", "1024", "--steps", "1", "--device-memory", f"{sized['limit_gib']:.6f}",
            "--no-progress", "-o", str(tmp_path / "a.png")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and not (tmp_path / "a.png").exists()
    lines = [ln for ln in done.stderr.strip().splitlines() if "memory" in ln]
    assert len(lines) == 1 and "more than the limit" in lines[0] and "per rank" in lines[0], done.stderr


@pytest.mark.slow
def test_a_pool_model_refuses_a_request_over_its_device_memory(sized: dict[str, Any]) -> None:
    """``omnicore serve A B --device-memory X`` / ``device_memory`` in models.toml: each pool engine checks its
    requests as a lone engine does (before, the pool dropped the limit and nothing was checked)."""
    from omnicore.pool import ModelEntry, ModelPool

    entry = ModelEntry(name="lingbot", checkpoint="tiny:lingbot", device_memory=sized["limit_gib"])
    assert entry.engine_kwargs()["device_memory"] == sized["limit_gib"]
    pool = ModelPool([entry], host=sized["host"], settings=sized["settings"])
    try:
        assert pool.generate("lingbot", "a fox", **SMALL, seed=0, timeout=300)  # loads the model, a small one fits
        with pytest.raises(MemoryLimitExceeded) as err:
            pool.submit(_request(BIG), model="lingbot")
        assert err.value.estimate_bytes == sized["big"].total
    finally:
        pool.close(cancel_running=True, timeout=30)


def test_serve_several_models_with_parallel_auto_plans_each(sized: dict[str, Any],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve A B --parallel auto``: one plan per model (the list is never handed to the planner), each entry
    keeping the placement and the limit auto planned with; ``--device-memory`` reaches every entry."""
    from omnicore.cli import plan_cmd
    from omnicore.cli.main import build_parser
    from omnicore.cli.serve_pool import pool_entries

    monkeypatch.setenv("OMNICORE_CACHE", str(sized["settings"].cache_path))
    monkeypatch.setattr(plan_cmd, "visible_devices", lambda: (1, 32.0, "float32", "cpu"))
    planned: list[str] = []
    real = plan_cmd.build_plan

    def counting(model: str, **kwargs: Any) -> Any:
        planned.append(model)
        return real(model, **kwargs)

    monkeypatch.setattr(plan_cmd, "build_plan", counting)
    args = build_parser().parse_args(["serve", "tiny:lingbot", "second=tiny:lingbot", "--parallel", "auto"])
    entries, _, _ = pool_entries(args, list(args.model), sized["settings"])
    assert planned == ["tiny:lingbot", "tiny:lingbot"]
    assert [(e.name, e.parallel, e.device_memory) for e in entries] == [("lingbot", None, 32.0),
                                                                         ("second", None, 32.0)]
    args = build_parser().parse_args(["serve", "tiny:lingbot", "tiny:minimax-h3", "--device-memory", "3"])
    entries, _, _ = pool_entries(args, list(args.model), sized["settings"])
    assert [e.device_memory for e in entries] == [3.0, 3.0]
