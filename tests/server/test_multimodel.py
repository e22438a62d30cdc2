"""Several models in one server (a ModelPool) over real HTTP: routing by `model`, equal outputs to one-model
servers, swaps under a budget in the stated order, pinned models, a corrupt checkpoint, fairness, the `loading`
phase and the per-model metrics. Models are toy checkpoints with different weights (their outputs are noise)."""

from __future__ import annotations

import base64
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from _server_helpers import LiveServer, SlowSteps, read_events


def _wait_status(c: httpx.Client, vid: str, statuses: tuple[str, ...], timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        job = c.get(f"/v1/videos/{vid}").json()
        if job["status"] in statuses:
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.02)


@pytest.fixture(scope="module")
def toy_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three toy checkpoints with different weights (so each model's output is its own)."""
    from toy import build_toy_checkpoint

    root = tmp_path_factory.mktemp("toy-models")
    return {name: build_toy_checkpoint(root / name, weight_seed=i + 1) for i, name in enumerate(("a", "b", "c"))}


@pytest.fixture(scope="module")
def toy_size(toy_dirs: dict[str, Path], toy_cache: Path) -> int:
    """The measured resident bytes of one toy model (all three have the same shapes)."""
    from omnicore.pool import resident_bytes
    from toy import toy_engine

    with toy_engine(toy_cache, str(toy_dirs["a"])) as engine:
        return resident_bytes(engine.pipeline, "cpu")


@pytest.fixture
def pool_server(toy_cache: Path, tmp_path: Path):
    started: list[LiveServer] = []

    def make(dirs: dict[str, Path], *, budget: int | None = None, pinned: tuple[str, ...] = (),
             step_delay_s: float = 0.0, state_dir: Path | None = None, **server_settings: Any) -> LiveServer:
        from omnicore.config import Settings
        from omnicore.pool import ModelEntry, ModelPool
        from omnicore.server import ServerSettings, create_app
        from toy import toy_host

        s = Settings(cache_dir=str(toy_cache))
        host = toy_host(s)
        if step_delay_s:
            host.add_plugin(SlowSteps(step_delay_s), "slow-steps")
        entries = [ModelEntry(name=n, checkpoint=str(d), pinned=n in pinned) for n, d in dirs.items()]
        pool = ModelPool(entries, host=host, settings=s, memory_budget=budget)
        ss = ServerSettings(state_dir=state_dir or tmp_path / "pool-state", **server_settings)
        srv = LiveServer(create_app(pool, ss)).start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        if srv.thread.is_alive():
            srv.stop()


def _image(c: httpx.Client, model: str | None, seed: int, prompt: str = "a red fox") -> bytes:
    body: dict[str, Any] = {"prompt": prompt, "size": "32x32", "seed": seed, "num_inference_steps": 2}
    if model is not None:
        body["model"] = model
    r = c.post("/v1/images/generations", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return base64.b64decode(r.json()["data"][0]["b64_json"])


def _single_model_images(toy_cache: Path, path: Path, seeds: list[int], tmp_path: Path) -> dict[int, bytes]:
    """The reference: a one-model server of the same checkpoint, same requests."""
    from omnicore.server import ServerSettings, create_app
    from toy import toy_engine

    srv = LiveServer(create_app(toy_engine(toy_cache, str(path)),
                                ServerSettings(state_dir=tmp_path / f"single-{path.name}"))).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            return {seed: _image(c, None, seed) for seed in seeds}
    finally:
        srv.stop()


@pytest.mark.parametrize(("n_models", "room"), [
    pytest.param(2, None, id="2-all-fit"), pytest.param(3, None, id="3-all-fit"),
    pytest.param(3, 1.5, id="3-room-for-one", marks=pytest.mark.slow),
])
def test_concurrent_requests_to_every_model_equal_one_model_servers(n_models, room, toy_dirs, toy_cache, toy_size,
                                                                     pool_server, tmp_path):
    """Concurrent requests to every model equal one-model servers, none lost: with the default budget (the
    machine's memory fits them all) and with room for one model at a time (every turn swaps)."""
    dirs = dict(list(toy_dirs.items())[:n_models])
    seeds = [3, 4]
    expected = {name: _single_model_images(toy_cache, d, seeds, tmp_path) for name, d in dirs.items()}
    assert len({expected[n][3] for n in dirs}) == n_models  # different weights: different images
    srv = pool_server(dirs, budget=None if room is None else int(toy_size * room))
    results: dict[tuple[str, int], bytes] = {}
    errors: list[BaseException] = []

    def client(name: str, seed: int) -> None:
        try:
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                results[(name, seed)] = _image(c, name, seed)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(n, s)) for n in dirs for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    assert len(results) == n_models * len(seeds)  # no request lost
    for (name, seed), png in results.items():
        assert png == expected[name][seed], (name, seed)
    with httpx.Client(base_url=srv.url) as c:
        cards = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in cards] == list(dirs)
        states = [m["omnicore"]["state"] for m in cards]
        if room is None:
            assert set(states) == {"loaded"} and all(m["omnicore"]["resident_bytes"] > 0 for m in cards)
        else:  # one resident at a time, and the models took turns on the device
            assert states.count("loaded") == 1 and set(states) <= {"loaded", "offloaded"}, states
            order = srv.ctx.pool.order
            assert all(("load", n) in order for n in dirs) and sum(a == "offload" for a, _ in order) >= 2, order


def test_unknown_model_is_404_naming_the_served_models(toy_dirs, pool_server):
    srv = pool_server({"a": toy_dirs["a"], "b": toy_dirs["b"]})
    with httpx.Client(base_url=srv.url) as c:
        r = c.post("/v1/images/generations", json={"prompt": "x", "model": "nope", "size": "32x32"})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model"
        assert "'a'" in err["message"] and "'b'" in err["message"]
        r = c.post("/v1/videos", json={"prompt": "x", "model": "nope", "num_frames": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert c.get("/v1/models/nope").status_code == 404
        assert c.get("/v1/models/b").json()["id"] == "b"


def test_a_budget_for_one_model_swaps_in_the_stated_order(toy_dirs, toy_size, pool_server):
    """Budget = 1.5 models: every request for another model offloads the loaded one (idle, least recently used)
    and loads or restores the requested one; outputs are the same before and after a swap."""
    srv = pool_server(dict(toy_dirs), budget=int(toy_size * 1.5))
    pool = srv.ctx.pool
    assert pool.order == [("load", "a")]  # preload: in order while they fit
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        first_a = _image(c, "a", 7)
        _image(c, "b", 7)
        _image(c, "c", 7)
        again_a = _image(c, "a", 7)
        states = {m["id"]: m["omnicore"]["state"] for m in c.get("/v1/models").json()["data"]}
        metrics = c.get("/metrics").text
    assert again_a == first_a  # the restored weights are the same weights
    assert pool.order == [("load", "a"), ("offload", "a"), ("load", "b"), ("offload", "b"), ("load", "c"),
                          ("offload", "c"), ("restore", "a")]
    assert states == {"a": "loaded", "b": "offloaded", "c": "offloaded"}
    assert 'omnicore_model_swaps_total{action="offload",model="a"} 1.0' in metrics
    assert 'omnicore_model_swaps_total{action="restore",model="a"} 1.0' in metrics
    assert 'omnicore_model_state{model="b",state="offloaded"} 1.0' in metrics
    assert f'omnicore_model_resident_bytes{{model="a"}} {float(toy_size)}' in metrics
    assert 'omnicore_model_resident_bytes{model="b"} 0.0' in metrics
    assert 'omnicore_model_queue_length{model="c"} 0.0' in metrics


def test_least_recently_used_idle_model_is_the_one_offloaded(toy_dirs, toy_size, pool_server):
    srv = pool_server(dict(toy_dirs), budget=int(toy_size * 2.5))  # two fit
    pool = srv.ctx.pool
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        _image(c, "b", 1)  # preloaded a and b; b is now the most recent
        _image(c, "a", 1)  # a is the most recent, b the least
        _image(c, "c", 1)  # room for c: b goes
        states = {m["id"]: m["omnicore"]["state"] for m in c.get("/v1/models").json()["data"]}
    assert pool.order == [("load", "a"), ("load", "b"), ("offload", "b"), ("load", "c")]
    assert states == {"a": "loaded", "b": "offloaded", "c": "loaded"}


def test_a_pinned_model_is_never_swapped(toy_dirs, toy_size, pool_server):
    srv = pool_server(dict(toy_dirs), budget=int(toy_size * 2.5), pinned=("c",))
    pool = srv.ctx.pool
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        for name in ("a", "b", "a", "b", "c", "a"):
            _image(c, name, 2)
        cards = {m["id"]: m["omnicore"] for m in c.get("/v1/models").json()["data"]}
    assert cards["c"]["pinned"] and cards["c"]["state"] == "loaded"
    assert pool.order[0] == ("load", "c")  # pinned first
    assert all(model != "c" for action, model in pool.order[1:]), pool.order
    assert ("offload", "a") in pool.order and ("offload", "b") in pool.order


def test_a_corrupt_checkpoint_fails_only_its_own_requests(toy_dirs, pool_server, tmp_path):
    import shutil

    bad = tmp_path / "corrupt"
    shutil.copytree(toy_dirs["b"], bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated: the load fails
    srv = pool_server({"a": toy_dirs["a"], "bad": bad})
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        cards = {m["id"]: m["omnicore"] for m in c.get("/v1/models").json()["data"]}
        assert cards["bad"]["state"] == "failed" and "safetensors" in cards["bad"]["error"].lower() or \
            cards["bad"]["error"], cards["bad"]
        r = c.post("/v1/images/generations", json={"prompt": "x", "model": "bad", "size": "32x32"})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "model_unavailable" and "'bad'" in err["message"], err
        r = c.post("/v1/videos", json={"prompt": "x", "model": "bad", "num_frames": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable"
        assert _image(c, "a", 1)  # the other model serves
        assert c.get("/health").json()["models"] == {"a": "loaded", "bad": "failed"}


def test_a_request_for_a_cold_model_waits_in_a_visible_loading_phase(toy_dirs, toy_size, pool_server):
    srv = pool_server({"a": toy_dirs["a"], "b": toy_dirs["b"]}, budget=int(toy_size * 1.5), step_delay_s=0.2)
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        busy = c.post("/v1/videos", json={"prompt": "busy", "model": "a", "num_frames": 2,
                                          "num_inference_steps": 6}).json()["id"]
        _wait_status(c, busy, ("in_progress",))
        cold = c.post("/v1/videos", json={"prompt": "cold", "model": "b", "num_frames": 2,
                                          "num_inference_steps": 2})
        assert cold.status_code == 200, cold.text
        vid = cold.json()["id"]
        with c.stream("GET", f"/v1/videos/{vid}/events", timeout=120) as resp:
            events = read_events(resp, stop=lambda ev: ev["event"] in ("video.completed", "video.failed"))
        phases = [ev["data"].get("phase") for ev in events if ev["event"] == "video.progress"]
        assert "loading" in phases, phases
        assert phases.index("loading") < phases.index("denoise"), phases
        assert events[-1]["event"] == "video.completed"
        assert _wait_status(c, busy, ("completed", "failed"))["status"] == "completed"


def test_a_hot_model_cannot_starve_a_cold_one(toy_dirs, toy_size, pool_server):
    """Fairness: with room for one model, a stream of requests to `a` that never lets its queue empty does not
    keep `b` out: `b` loads once the work `a` had admitted when `b` asked has finished, and every request of
    either model completes (none is dropped)."""
    srv = pool_server({"a": toy_dirs["a"], "b": toy_dirs["b"]}, budget=int(toy_size * 1.5), step_delay_s=0.05)
    stop = threading.Event()
    done: list[tuple[str, float]] = []
    failures: list[str] = []

    def hammer() -> None:  # keeps two requests to `a` in flight at all times
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            while not stop.is_set():
                r = c.post("/v1/images/generations", json={"prompt": "hot", "model": "a", "size": "32x32",
                                                           "num_inference_steps": 2, "seed": 1})
                (done if r.status_code == 200 else failures).append(("a", time.monotonic()) if r.status_code
                                                                      == 200 else r.text)

    hot = [threading.Thread(target=hammer) for _ in range(2)]
    for t in hot:
        t.start()
    try:
        time.sleep(1.0)  # `a` is hot
        t0 = time.monotonic()
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            _image(c, "b", 5, prompt="cold")
        waited = time.monotonic() - t0
        time.sleep(0.5)
    finally:
        stop.set()
        for t in hot:
            t.join(120)
    assert not failures, failures
    a_during = [t for _, t in done if t >= t0]
    assert waited < 30, waited
    assert a_during, "the hot model stopped being served"
    order = srv.ctx.pool.order
    assert ("load", "b") in order and order.index(("offload", "a")) < order.index(("load", "b"))
    assert ("restore", "a") in order[order.index(("load", "b")):]  # and `a` got its turn back


def test_engine_errors_of_one_model_leave_the_others_serving(toy_dirs, pool_server):
    srv = pool_server({"a": toy_dirs["a"], "b": toy_dirs["b"]})
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        r = c.post("/v1/images/generations", json={"prompt": "x", "model": "a", "size": "32x32",
                                                   "model_params": {"fail_at": "denoise"}, "num_inference_steps": 2})
        assert r.status_code == 500
        assert _image(c, "b", 1) and _image(c, "a", 1)
