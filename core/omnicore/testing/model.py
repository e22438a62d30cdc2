"""Checks for model plugins: :class:`ModelPluginConformance` runs the tiny preset end to end through
:class:`omnicore.Engine` on CPU.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..config import Settings
from ..errors import InvalidRequest
from ..plugins.host import PluginHost
from .plugin import add_to_host, isolated_host


def output_bytes(outputs: list[Any]) -> list[bytes]:
    """Everything an output carries that must be reproducible: frames, audio, fps and sample rate."""
    blobs = []
    for out in outputs:
        audio = b"" if out.audio is None else out.audio.tobytes()
        meta = f"{out.kind}|{out.frames.shape}|{out.fps}|{out.sample_rate}".encode()
        blobs.append(meta + out.frames.tobytes() + audio)
    return blobs


def rewrite_weights(src: Path, dst: Path, transform: Any = None) -> int:
    """Copy checkpoint ``src`` to ``dst``, re-serialising every ``*.safetensors`` file through our own load and
    save (optionally transforming each floating tensor). Returns the number of tensors written."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    count = 0
    for file in sorted(dst.rglob("*.safetensors")):
        tensors = load_file(str(file))
        if transform is not None:
            tensors = {k: (transform(t) if t.is_floating_point() else t) for k, t in tensors.items()}
        file.unlink()
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(file))
        count += len(tensors)
    return count


class ModelPluginConformance:
    """End-to-end checks of a model plugin's tiny preset through the engine.

    Attributes to set:
      ``model``: the preset to run, e.g. ``"tiny:lingbot"``. Required.
      ``plugin_module``: entry-point target registering the model (``"omni_lingbot.plugin"``). Required.
      ``params``: sampling parameters for the runs; keep them tiny (few steps, small sizes).
      ``invalid_params``: ``{field: bad value}``; each must raise ``InvalidRequest`` naming ``params.<field>``.
      ``engine_options``: extra keyword arguments for :class:`omnicore.Engine`.
    """

    model: str = ""
    plugin_module: str = ""
    plugin_name: str | None = None
    prompt: str = "a small red cube on a wooden table"
    params: dict[str, Any] = {"num_inference_steps": 2}
    seed: int = 1234
    invalid_params: dict[str, Any] = {"height": -8, "num_inference_steps": 0, "guidance_scale": float("nan")}
    engine_options: dict[str, Any] = {}

    # ------------------------------------------------------------------ fixtures
    @classmethod
    def make_host(cls, settings: Settings) -> PluginHost:
        """The isolated host the engine runs on; override (as a classmethod) to register extra plugins."""
        if not (cls.model and cls.plugin_module):
            pytest.fail(f"{cls.__name__}: set `model` (e.g. 'tiny:<name>') and `plugin_module`")
        host = isolated_host(settings)
        name = cls.plugin_name or cls.plugin_module.split(":")[0].split(".")[0]
        record = add_to_host(host, cls.plugin_module, name)
        assert record.status == "loaded", f"{record.name}: {record.error}\n{record.traceback}"
        return host

    @classmethod
    def make_engine(cls, model: str | Path, settings: Settings) -> Any:
        from ..engine.api import Engine

        return Engine(model, host=cls.make_host(settings), settings=settings, **cls.engine_options)

    @pytest.fixture(scope="class")
    @classmethod
    def model_settings(cls, tmp_path_factory: pytest.TempPathFactory) -> Settings:
        return Settings(cache_dir=str(tmp_path_factory.mktemp("omnicore-cache")))

    @pytest.fixture(scope="class")
    @classmethod
    def model_engine(cls, model_settings: Settings) -> Iterator[Any]:
        engine = cls.make_engine(cls.model, model_settings)
        try:
            yield engine
        finally:
            engine.close()

    def run(self, engine: Any, **overrides: Any) -> list[Any]:
        params = {"seed": self.seed, **self.params, **overrides}
        return engine.generate(self.prompt, **params)

    # ------------------------------------------------------------------ checks
    def test_output_shape_and_type(self, model_engine: Any) -> None:
        from ..outputs.output import Output

        spec = model_engine.spec
        outputs = self.run(model_engine)
        assert isinstance(outputs, list) and len(outputs) == self.params.get("num_outputs", 1)
        height = self.params.get("height", spec.defaults.height)
        width = self.params.get("width", spec.defaults.width)
        for out in outputs:
            assert isinstance(out, Output)
            assert out.kind in spec.capabilities.outputs, f"{out.kind!r} not in declared {spec.capabilities.outputs}"
            assert out.frames.dtype.name == "uint8" and out.frames.ndim == 4 and out.frames.shape[-1] == 3
            assert (out.height, out.width) == (height, width), f"output {out.width}x{out.height}, asked {width}x{height}"
            if out.kind == "video":
                assert out.fps and out.fps > 0
                frames = self.params.get("num_frames")
                if frames is not None:
                    assert out.num_frames == frames
            if out.audio is not None:
                import numpy as np

                assert "audio" in spec.capabilities.outputs
                assert out.sample_rate and out.sample_rate > 0
                assert out.audio.ndim == 2 and bool(np.isfinite(out.audio).all())
            assert out.seed == self.seed + out.index

    def test_same_seed_gives_identical_bytes(self, model_engine: Any) -> None:
        first, second = self.run(model_engine), self.run(model_engine)
        assert output_bytes(first) == output_bytes(second), "same seed, different outputs: generation is not deterministic"

    def test_seed_changes_the_output(self, model_engine: Any) -> None:
        a, b = self.run(model_engine), self.run(model_engine, seed=self.seed + 1)
        assert output_bytes(a) != output_bytes(b), "changing the seed did not change the output"

    def test_invalid_requests_name_the_field(self, model_engine: Any) -> None:
        for field, bad in self.invalid_params.items():
            with pytest.raises(InvalidRequest) as info:
                self.run(model_engine, **{field: bad})
            assert info.value.field == f"params.{field}", f"{field}={bad!r} was reported as {info.value.field!r}"
        with pytest.raises(InvalidRequest) as info:
            model_engine.generate("   ", **self.params)
        assert info.value.field == "prompt"

    def test_weight_round_trip_gives_identical_outputs(self, model_engine: Any, model_settings: Settings,
                                                       tmp_path: Path) -> None:
        """Saving the preset's weights and loading them from a local directory reproduces the outputs
        exactly, and changing the weights changes them (the loader really reads the files)."""
        source = Path(model_engine.resolved.path)
        expected = output_bytes(self.run(model_engine))
        copy = tmp_path / "round-trip"
        assert rewrite_weights(source, copy) > 0, f"no *.safetensors weights found under {source}"
        engine = self.make_engine(copy, model_settings)
        try:
            assert output_bytes(self.run(engine)) == expected, "outputs changed after a save -> load round trip"
        finally:
            engine.close()
        perturbed = tmp_path / "perturbed"
        rewrite_weights(source, perturbed, transform=lambda t: t * 1.5 + 0.05)
        engine = self.make_engine(perturbed, model_settings)
        try:
            assert output_bytes(self.run(engine)) != expected, "changing every weight did not change the output"
        finally:
            engine.close()
