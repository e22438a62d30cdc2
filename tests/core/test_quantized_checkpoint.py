"""Pre-quantized checkpoints in omnicore's layout (safetensors + scales): saving a quantized pipeline and loading
it back gives the online quantization's tensors bit for bit, the values come from the file (not recomputed), and a
mismatching file is refused naming what differs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("omni_lingbot", reason="the LingBot plugin (plugins/lingbot) is not installed")

from omnicore.config import resolve_settings  # noqa: E402
from omnicore.engine.api import Engine, make_request  # noqa: E402
from omnicore.errors import InvalidRequest  # noqa: E402
from omnicore.plugin_host.host import PluginHost  # noqa: E402
from omnicore.quantization import apply_to_pipeline, resident_bytes  # noqa: E402
from omnicore.quantization.checkpoint import _flat_state, load_quantized, read_index, save_quantized  # noqa: E402

REQUEST = {"height": 32, "width": 32, "num_frames": 1, "num_inference_steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    root = tmp_path_factory.mktemp("prequant")
    settings = resolve_settings({"cache_dir": str(root / "cache")})
    return PluginHost(settings), settings, root


@pytest.mark.parametrize("backend", ["reference", "torchao"])
def test_round_trip_equals_online_quantization_bit_for_bit(backend: str, env: tuple[Any, Any, Path]) -> None:
    from omnicore.quantization import torchao_available

    if backend == "torchao" and not torchao_available():
        pytest.skip("torchao is not installed")
    host, settings, root = env
    with Engine("tiny:lingbot", host=host, settings=settings) as online:
        report = apply_to_pipeline(online.pipeline, online.spec, "int8", backend=backend)
        out = save_quantized(online.pipeline, online.spec, root / f"q-{backend}", report)
        expected = {k: _flat_state(m) for k, (m, _) in _targets(online).items()}
        frames = online.submit(make_request("a red fox", **REQUEST)).result(600)[0].frames
        sizes = {k: resident_bytes(m) for k, (m, _) in _targets(online).items()}
    index = read_index(out)
    assert index["mode"] == "int8" and index["linear_backend"] == backend
    assert set(index["components"]) == set(expected) and all((out / c["file"]).is_file()
                                                             for c in index["components"].values())
    with Engine("tiny:lingbot", host=host, settings=settings) as fresh:
        with torch.no_grad():  # other values than the file's: the load must take the file's, not recompute
            for p in fresh.pipeline.transformer.parameters():
                p.add_(0.01)
        load_quantized(fresh.pipeline, fresh.spec, out, "int8")
        got = {k: _flat_state(m) for k, (m, _) in _targets(fresh).items()}
        assert {k: resident_bytes(m) for k, (m, _) in _targets(fresh).items()} == sizes
        again = fresh.submit(make_request("a red fox", **REQUEST)).result(600)[0].frames
    for name, state in expected.items():
        assert got[name].keys() == state.keys()
        for key, value in state.items():
            assert got[name][key].dtype == value.dtype and torch.equal(got[name][key], value), (name, key)
    assert np.array_equal(np.asarray(frames), np.asarray(again))


def _targets(engine: Any) -> Any:
    from omnicore.quantization.checkpoint import _targets as targets

    return targets(engine.pipeline, engine.spec)


def test_engine_loads_quantized_dir_of_the_checkpoint(env: tuple[Any, Any, Path]) -> None:
    """``<checkpoint>/quantized/int8/`` is what Engine(quantization="int8") loads; a mode it does not hold or a
    file of another model is refused naming the difference."""
    import shutil

    host, settings, root = env
    with Engine("tiny:lingbot", host=host, settings=settings, quantization="int8") as online:
        path = online.resolved.path
        save_quantized(online.pipeline, online.spec, path / "quantized" / "int8", online.quantization_report)
        frames = online.submit(make_request("a red fox", **REQUEST)).result(600)[0].frames
    index = json.loads((path / "quantized" / "int8" / "quantization.json").read_text())
    with Engine("tiny:lingbot", host=host, settings=settings, quantization="int8") as engine:
        assert engine.quantization_report.keys() == index["components"].keys()
        assert np.array_equal(np.asarray(frames),
                              np.asarray(engine.submit(make_request("a red fox", **REQUEST)).result(600)[0].frames))
        with pytest.raises(InvalidRequest, match="holds int8 weights, asked for fp8"):
            load_quantized(engine.pipeline, engine.spec, path / "quantized" / "int8", "fp8")
    broken = root / "broken"
    shutil.copytree(path / "quantized" / "int8", broken)
    index["components"]["transformer"]["linears"] = index["components"]["transformer"]["linears"][:-1]
    (broken / "quantization.json").write_text(json.dumps(index))
    with Engine("tiny:lingbot", host=host, settings=settings) as engine:
        with pytest.raises(InvalidRequest, match="transformer's quantized weights differ"):
            load_quantized(engine.pipeline, engine.spec, broken, "int8")
    shutil.rmtree(path / "quantized")
