"""ModelPool through its Python API: entries and models.toml, sizes, the host swap, equal outputs to a lone Engine,
the budget policy (refusal, host budget, priority, cancel while waiting) and the CLI's several-model parsing.
Toy checkpoints with different weights stand for different models (their outputs are noise)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from omnicore.errors import ConfigError, ModelUnavailable, QueueFull, UnknownName


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from toy import build_toy_checkpoint

    root = tmp_path_factory.mktemp("pool-models")
    return {n: build_toy_checkpoint(root / n, weight_seed=i + 1) for i, n in enumerate(("a", "b", "c"))}


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pool-cache")


def _pool(dirs: dict[str, Path], cache: Path, *, budget: int | None = None, **entry_kw: dict):
    from omnicore.config import Settings
    from omnicore.pool import ModelEntry, ModelPool
    from toy import toy_host

    s = Settings(cache_dir=str(cache))
    entries = [ModelEntry(name=n, checkpoint=str(d), **entry_kw.get(n, {})) for n, d in dirs.items()]
    return ModelPool(entries, host=toy_host(s), settings=s, memory_budget=budget)


def _pixels(outputs: list) -> np.ndarray:
    return np.asarray(outputs[0].data if hasattr(outputs[0], "data") else outputs[0].frames)


@pytest.fixture(scope="module")
def size(dirs: dict[str, Path], cache: Path) -> int:
    from omnicore.pool import resident_bytes
    from toy import toy_engine

    with toy_engine(cache, str(dirs["a"])) as engine:
        return resident_bytes(engine.pipeline, "cpu")


def test_parse_bytes_units_and_errors():
    from omnicore.pool import parse_bytes

    assert parse_bytes("b", "24GiB") == 24 * 1024**3
    assert parse_bytes("b", "1.5G") == 1_500_000_000
    assert parse_bytes("b", "800MB") == 800_000_000 and parse_bytes("b", 1234) == 1234
    assert parse_bytes("b", None) is None and parse_bytes("b", "") is None
    for bad in ("lots", "12 parsecs", "-1G", "0", True):
        with pytest.raises(ConfigError, match="--memory-budget"):
            parse_bytes("--memory-budget", bad)


def test_models_toml_entries_and_errors(tmp_path, dirs):
    from omnicore.pool import load_models_file

    (tmp_path / "models.toml").write_text(f'''
[pool]
memory_budget = "1GiB"

[[model]]
checkpoint = "{dirs["a"]}"
name = "first"
aliases = ["one"]
priority = 5
pinned = true
options = {{ }}
max_queue = 3
[model.defaults]
num_inference_steps = 2

[[model]]
checkpoint = "tiny:toy"
''')
    found = load_models_file(tmp_path / "models.toml")
    assert found.memory_budget == 1024**3 and found.host_memory_budget is None
    first, second = found.entries
    assert (first.name, first.aliases, first.priority, first.pinned, first.max_queue) == ("first", ("one",), 5, True,
                                                                                         3)
    assert dict(first.defaults) == {"num_inference_steps": 2}
    assert second.name == "toy" and second.checkpoint == "tiny:toy"
    cases = {
        "[[model]]\nname = 'x'\n": "model[0].checkpoint",
        "[[model]]\ncheckpoint = 'tiny:toy'\ncolour = 'red'\n": "model[0].colour",
        "[[model]]\ncheckpoint = 'tiny:toy'\npriority = 'high'\n": "priority",
        "[[model]]\ncheckpoint = 'tiny:toy'\n[[model]]\ncheckpoint = 'tiny:toy'\n": "two models are named 'toy'",
        "[pool]\nmemory_budget = 'a lot'\n[[model]]\ncheckpoint = 'tiny:toy'\n": "pool.memory_budget",
        "[[model]]\ncheckpoint = 'tiny:toy'\nparallel = 'cfg=3'\n": "parallel",
        "[[model]]\ncheckpoint = 'tiny:toy'\n[model.defaults]\nsteps = 2\n": "defaults.steps",
        "model = [": "not valid TOML",
    }
    for text, message in cases.items():
        (tmp_path / "bad.toml").write_text(text)
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
            load_models_file(tmp_path / "bad.toml")


def test_entries_from_arguments_name_each_model_and_refuse_clashes():
    from omnicore.pool import entries_from_args

    entries = entries_from_args(["tiny:lingbot", "video=tiny:minimax-h3", "/ckpts/flux-dev/"])
    assert [(e.name, e.checkpoint) for e in entries] == [("lingbot", "tiny:lingbot"), ("video", "tiny:minimax-h3"),
                                                        ("flux-dev", "/ckpts/flux-dev/")]
    assert entries[0].names == ("lingbot",)  # (the pool adds the checkpoint argument where it is unambiguous)
    with pytest.raises(ConfigError, match="two models are named 'lingbot'"):
        entries_from_args(["tiny:lingbot", "lingbot=tiny:minimax-h3"])


def test_host_swap_round_trip_keeps_parameter_objects_and_values(dirs, cache):
    import torch
    from omnicore.pool import HostSwap, resident_bytes
    from toy import toy_engine

    with toy_engine(cache, str(dirs["a"])) as engine:
        params = dict(engine.pipeline.model.named_parameters())
        before = {k: p.detach().clone() for k, p in params.items()}
        full = resident_bytes(engine.pipeline, "cpu")
        assert full == sum(p.numel() * p.element_size() for p in params.values()) + sum(
            b.numel() * b.element_size() for b in engine.pipeline.model.buffers())
        swap = HostSwap(engine.pipeline, "cpu")
        assert resident_bytes(engine.pipeline, "cpu") == 0 and swap.nbytes == full
        assert all(p.numel() == 0 for p in params.values())
        swap.restore()
        assert resident_bytes(engine.pipeline, "cpu") == full
        after = dict(engine.pipeline.model.named_parameters())
        assert all(after[k] is params[k] and torch.equal(after[k], before[k]) for k in params)


def test_pool_outputs_equal_a_lone_engine_and_survive_swaps(dirs, cache, size):
    from toy import toy_engine

    expected = {}
    for name in ("a", "b"):
        with toy_engine(cache, str(dirs[name])) as engine:
            expected[name] = _pixels(engine.generate("a fox", seed=11, num_inference_steps=2))
    assert not np.array_equal(expected["a"], expected["b"])
    with _pool({"a": dirs["a"], "b": dirs["b"]}, cache, budget=int(size * 1.5)) as pool:
        for name in ("a", "b", "a", "b"):
            assert np.array_equal(_pixels(pool.generate(name, "a fox", seed=11, num_inference_steps=2)),
                                  expected[name]), name
        assert pool.order == [("load", "a"), ("offload", "a"), ("load", "b"), ("offload", "b"), ("restore", "a"),
                              ("offload", "a"), ("restore", "b")]
        status = pool.status()
        assert status["b"].state == "loaded" and status["b"].resident_bytes == size
        assert status["a"].state == "offloaded" and status["a"].resident_bytes == 0
        assert status["a"].counters.offloads == 2 and status["a"].counters.restores == 1
        with pytest.raises(UnknownName, match="known: a .*, b "):
            pool.generate("zzz", "x")


def test_a_first_load_reports_an_eta_from_the_other_models_loads(dirs, cache, size):
    """A model the pool never loaded has no load time of its own: its waiting jobs get its estimated bytes at the
    speed the pool loaded another model, counting down while it loads."""
    from omnicore.engine.api import make_request

    with _pool({"a": dirs["a"], "b": dirs["b"]}, cache, budget=int(size * 1.5)) as pool:
        assert pool.state_of("a") == "loaded" and pool.state_of("b") == "unloaded"  # a loaded at start-up
        events: list = []
        pool.submit(make_request("a fox", seed=1, num_inference_steps=1), model="b",
                    on_event=lambda ev: events.append(ev) if ev.phase == "loading" else None).result(60)
        etas = [ev.eta_s for ev in events]
        assert etas and all(e is not None and e >= 0 for e in etas), etas
        assert etas == sorted(etas, reverse=True)


def test_the_resident_models_keep_serving_while_another_loads(dirs, cache, size):
    """Room for two of three: a request for the third evicts one idle model and loads (slowly here); the model
    still resident answers requests during that load."""
    import threading
    import time

    from omnicore.engine.api import make_request

    with _pool(dirs, cache, budget=int(size * 2.5)) as pool:
        assert [pool.state_of(m) for m in "abc"] == ["loaded", "loaded", "unloaded"]
        release = threading.Event()
        build = pool._build

        def slow_build(slot):
            if slot.entry.name == "c":
                release.wait(60)
            build(slot)

        pool._build = slow_build
        job = pool.submit(make_request("a fox", seed=1, num_inference_steps=1), model="c")
        deadline = time.monotonic() + 30
        while pool.state_of("c") != "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        resident = [m for m in "ab" if pool.state_of(m) == "loaded"]
        assert pool.state_of("c") == "loading" and len(resident) == 1
        for seed in (2, 3):
            assert pool.generate(resident[0], "a fox", seed=seed, num_inference_steps=1, timeout=30)
        assert pool.state_of("c") == "loading"  # both answered during c's load
        release.set()
        assert job.result(60)


def test_priority_keeps_a_model_resident_longer(dirs, cache, size):
    with _pool(dict(dirs), cache, budget=int(size * 2.5), a={"priority": 10}) as pool:
        pool.generate("b", "x", seed=1, num_inference_steps=1)
        pool.generate("a", "x", seed=1, num_inference_steps=1)
        pool.generate("b", "x", seed=1, num_inference_steps=1)  # a is least recent, but has the higher priority
        pool.generate("c", "x", seed=1, num_inference_steps=1)
        assert pool.order[-2:] == [("offload", "b"), ("load", "c")]


def test_a_model_larger_than_the_budget_is_refused_with_a_clear_error(dirs, cache, size):
    with _pool({"a": dirs["a"], "b": dirs["b"]}, cache, budget=int(size * 1.5), a={"pinned": True}) as pool:
        job = pool.submit(_request(), model="b")  # a is pinned: b can never fit beside it
        assert job.wait(30) and job.status == "failed"
        assert isinstance(job.error, ModelUnavailable) and "pinned" in str(job.error) and "'b'" in str(job.error)
        assert pool.state_of("a") == "loaded"
        with pytest.raises(ModelUnavailable, match="pinned"):  # ModelPool.load says so too, instead of waiting
            pool.load("b", timeout=30)


def test_host_budget_unloads_the_least_recently_used_offloaded_model(dirs, cache, size):
    from omnicore.config import Settings
    from omnicore.pool import ModelEntry, ModelPool
    from toy import toy_host

    s = Settings(cache_dir=str(cache))
    with ModelPool([ModelEntry(name=n, checkpoint=str(d)) for n, d in dirs.items()], host=toy_host(s), settings=s,
                   memory_budget=int(size * 1.5), host_memory_budget=int(size * 1.5)) as pool:
        for name in ("a", "b", "c"):
            pool.generate(name, "x", seed=1, num_inference_steps=1)
        assert pool.wait_idle(30)
        assert ("unload", "a") in pool.order and pool.state_of("a") == "unloaded"
        assert pool.state_of("b") == "offloaded" and pool.state_of("c") == "loaded"
        pool.generate("a", "x", seed=1, num_inference_steps=1)  # unloaded: built again from its checkpoint
        assert pool.status()["a"].counters.loads == 2


def _request():
    from omnicore.engine.api import make_request

    return make_request("x", seed=1, num_inference_steps=1)


def test_waiting_jobs_can_be_cancelled_and_queue_limits_are_per_model(dirs, cache, size):
    from _server_helpers import SlowSteps
    from omnicore.config import Settings
    from omnicore.pool import ModelEntry, ModelPool
    from toy import toy_host

    s = Settings(cache_dir=str(cache))
    host = toy_host(s)
    host.add_plugin(SlowSteps(0.2), "slow-steps")
    entries = [ModelEntry(name="a", checkpoint=str(dirs["a"])), ModelEntry(name="b", checkpoint=str(dirs["b"]),
                                                                             max_queue=2)]
    with ModelPool(entries, host=host, settings=s, memory_budget=int(size * 1.5)) as pool:
        busy = pool.submit(_request(), model="a")
        first = pool.submit(_request(), model="b")
        second = pool.submit(_request(), model="b")
        with pytest.raises(QueueFull):
            pool.submit(_request(), model="b")  # b's own limit (a's is the server-wide one)
        assert first.progress is not None and first.progress.phase == "loading"
        assert first.cancel() and first.wait(5) and first.status == "cancelled"
        assert second.result(60) and busy.result(60)
        assert pool.wait_idle(30)


def test_a_failed_load_fails_only_that_model(dirs, cache, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(dirs["b"], bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    with _pool({"a": dirs["a"], "bad": bad}, cache) as pool:
        assert pool.state_of("bad") == "failed" and pool.state_of("a") == "loaded"
        with pytest.raises(ModelUnavailable, match="'bad' is unavailable"):
            pool.submit(_request(), model="bad")
        assert pool.generate("a", "x", seed=1, num_inference_steps=1)
        assert "bad" in (pool.status()["bad"].error or "") or pool.status()["bad"].error


def test_serve_takes_several_models_and_the_pool_flags():
    from omnicore.cli.main import build_parser
    from omnicore.config import flags_from_args, resolve_settings

    args = build_parser().parse_args(["serve", "tiny:lingbot", "tiny:minimax-h3", "--memory-budget", "2GiB",
                                      "--host-memory-budget", "8GB", "--models", "m.toml"])
    assert args.model == ["tiny:lingbot", "tiny:minimax-h3"]
    settings = resolve_settings(flags_from_args(args, "global", "engine", "server"), env={})
    assert settings.memory_budget == 2 * 1024**3 and settings.host_memory_budget == 8_000_000_000
    assert settings.models_file == "m.toml"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "tiny:lingbot", "--memory-budget", "plenty"])


def test_the_readme_models_toml_parses_as_written(tmp_path):
    """The README's models.toml example is a valid file (so the documented keys cannot drift from the parser)."""
    import re

    from omnicore.pool.entries import load_models_file

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"```toml\n(# models\.toml.*?)```", readme, flags=re.S)
    assert block is not None
    path = tmp_path / "models.toml"
    path.write_text(block.group(1))
    parsed = load_models_file(path)
    assert [e.name for e in parsed.entries] == ["video", "image"]
    video, image = parsed.entries
    assert (video.priority, video.max_queue, image.pinned) == (10, 32, True)
    assert image.defaults["num_inference_steps"] == 8 and parsed.memory_budget == 24 * 1024**3
