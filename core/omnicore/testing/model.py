"""Checks for model plugins: :class:`ModelPluginConformance` runs the tiny preset end to end through
:class:`omnicore.Engine` on CPU.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from ..config import Settings
from ..errors import Cancelled, InvalidRequest, UnsupportedFeature
from ..plugin_host.host import PluginHost
from .plugin import add_loaded, isolated_host
from .runtime import (
    SPY_BACKEND,
    SpyAttentionPlugin,
    assert_close_outputs,
    check_progress_events,
    counting_steps,
    held_worker,
    spy_calls,
)

if TYPE_CHECKING:
    import torch

    from ..engine.api import Engine
    from ..engine.jobs import Job
    from ..engine.progress import ProgressEvent
    from ..engine.request import GenerationRequest
    from ..outputs.output import Output


def output_bytes(outputs: list[Output]) -> list[bytes]:
    """Everything an output carries that must be reproducible: frames, audio, fps and sample rate."""
    blobs = []
    for out in outputs:
        audio = b"" if out.audio is None else out.audio.tobytes()
        meta = f"{out.kind}|{out.frames.shape}|{out.fps}|{out.sample_rate}".encode()
        blobs.append(meta + out.frames.tobytes() + audio)
    return blobs


def rewrite_weights(src: Path, dst: Path, transform: Callable[[torch.Tensor], torch.Tensor] | None = None) -> int:
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
      ``runtime_steps``: the fewest denoise steps of the cancellation, progress and batching checks.
      ``batch_max_abs_diff`` / ``batch_audio_atol``: how far a batched run may be from solo runs (uint8 levels of
      the frames; absolute audio error).
    """

    model: str = ""
    plugin_module: str = ""
    plugin_name: str | None = None
    prompt: str = "a small red cube on a wooden table"
    params: dict[str, Any] = {"num_inference_steps": 2}
    seed: int = 1234
    invalid_params: dict[str, object] = {"height": -8, "num_inference_steps": 0, "guidance_scale": float("nan")}
    engine_options: dict[str, Any] = {}
    runtime_steps: int = 3
    batch_max_abs_diff: int = 2
    batch_audio_atol: float = 1e-3

    # ------------------------------------------------------------------ fixtures
    @classmethod
    def make_host(cls, settings: Settings) -> PluginHost:
        """The isolated host the engine runs on; override (as a classmethod) to register extra plugins."""
        if not (cls.model and cls.plugin_module):
            pytest.fail(f"{cls.__name__}: set `model` (e.g. 'tiny:<name>') and `plugin_module`")
        host = isolated_host(settings)
        add_loaded(host, cls.plugin_module, cls.plugin_name)
        return host

    @classmethod
    def make_engine(cls, model: str | Path, settings: Settings) -> Engine:
        from ..engine.api import Engine

        return Engine(model, host=cls.make_host(settings), settings=settings, **cls.engine_options)

    @pytest.fixture(scope="class")
    @classmethod
    def model_settings(cls, tmp_path_factory: pytest.TempPathFactory) -> Settings:
        return Settings(cache_dir=str(tmp_path_factory.mktemp("omnicore-cache")))

    @pytest.fixture(scope="class")
    @classmethod
    def model_engine(cls, model_settings: Settings) -> Iterator[Engine]:
        engine = cls.make_engine(cls.model, model_settings)
        try:
            yield engine
        finally:
            engine.close()

    def run(self, engine: Engine, **overrides: Any) -> list[Output]:
        params = {"seed": self.seed, **self.params, **overrides}
        return engine.generate(self.prompt, **params)

    def request(self, seed: int, **overrides: Any) -> GenerationRequest:
        """The request :meth:`run` would make, for checks that submit jobs themselves."""
        from ..engine.api import make_request

        return make_request(self.prompt, **{**self.params, **overrides, "seed": seed})

    def runtime_params(self) -> dict[str, int]:
        return {"num_inference_steps": max(self.runtime_steps, self.params.get("num_inference_steps") or 0)}

    # ------------------------------------------------------------------ checks
    def test_output_shape_and_type(self, model_engine: Engine) -> None:
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
            assert (out.height, out.width) == (height, width), (
                f"output {out.width}x{out.height}, asked {width}x{height}")
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

    def test_same_seed_gives_identical_bytes(self, model_engine: Engine) -> None:
        first, second = self.run(model_engine), self.run(model_engine)
        assert output_bytes(first) == output_bytes(second), (
            "same seed, different outputs: generation is not deterministic")

    def test_seed_changes_the_output(self, model_engine: Engine) -> None:
        a, b = self.run(model_engine), self.run(model_engine, seed=self.seed + 1)
        assert output_bytes(a) != output_bytes(b), "changing the seed did not change the output"

    def test_invalid_requests_name_the_field(self, model_engine: Engine) -> None:
        for field, bad in self.invalid_params.items():
            with pytest.raises(InvalidRequest) as info:
                self.run(model_engine, **{field: bad})
            assert info.value.field == f"params.{field}", f"{field}={bad!r} was reported as {info.value.field!r}"
        with pytest.raises(InvalidRequest) as info:
            model_engine.generate("   ", **self.params)
        assert info.value.field == "prompt"

    def test_weight_round_trip_gives_identical_outputs(self, model_engine: Engine, model_settings: Settings,
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

    # ------------------------------------------------------------------ runtime: cancellation, progress, batching
    def test_cancellation_mid_run_stops_within_one_step(self, model_engine: Engine) -> None:
        """Cancelling a running job after its first step ends it before two more steps ran, and the engine
        serves the next request normally."""
        steps = self.runtime_params()
        events: list[ProgressEvent] = []
        submitted = threading.Event()
        jobs: list[Job] = []

        def cancel_after_first_step(event: ProgressEvent) -> None:
            events.append(event)
            if event.phase == "denoise" and event.step == 1:
                submitted.wait(60)  # the worker may get here before submit() returned the job
                jobs[0].cancel()

        with counting_steps(model_engine.host) as counter:
            jobs.append(model_engine.submit(self.request(self.seed, **steps), on_event=cancel_after_first_step))
            submitted.set()
            job = jobs[0]
            job.wait(300)
        ran = counter.steps.get(job.id, 0)
        assert job.status == "cancelled", f"the job ended {job.status!r} after cancel()"
        with pytest.raises(Cancelled):
            job.result(0)
        assert 1 <= ran <= 2, f"{ran} denoise steps ran for a job cancelled after step 1 (at most 1 more may run)"
        assert max(e.step for e in events if e.phase == "denoise") == 1, "progress went on after cancellation"
        assert len(self.run(model_engine)) == self.params.get("num_outputs", 1), "the engine broke after a cancel"

    def test_progress_once_per_step_and_monotone(self, model_engine: Engine) -> None:
        events: list[ProgressEvent] = []
        steps = self.runtime_params()
        model_engine.submit(self.request(self.seed, **steps), on_event=events.append).result(300)
        check_progress_events(events, steps["num_inference_steps"])

    def _solo(self, engine: Engine, seed: int) -> list[Output]:
        return engine.submit(self.request(seed, **self.runtime_params())).result(300)

    def test_batched_run_equals_solo_runs(self, model_engine: Engine) -> None:
        if not model_engine.spec.capabilities.supports_batching:
            pytest.skip(f"model {model_engine.spec.name!r} declares supports_batching=False")
        seeds = (self.seed + 10, self.seed + 20)
        with held_worker(model_engine, self.request(seeds[0], **self.runtime_params())) as first_solo:
            jobs = [model_engine.submit(self.request(s, **self.runtime_params())) for s in seeds]
        batched = [j.result(300) for j in jobs]
        solo = [first_solo.result(0), self._solo(model_engine, seeds[1])]
        for outs in batched:
            assert all(o.metrics.get("batch_requests") == 2 for o in outs), (
                "the two queued requests did not run as one batch (same batch key expected for equal parameters)")
        for seed, b, s in zip(seeds, batched, solo):
            assert_close_outputs(b, s, self.batch_max_abs_diff, self.batch_audio_atol,
                                 f"seed {seed}: batched run vs solo run")

    def test_cancelling_one_of_a_batch_leaves_the_other_equal_to_its_solo_run(self, model_engine: Engine) -> None:
        if not model_engine.spec.capabilities.supports_batching:
            pytest.skip(f"model {model_engine.spec.name!r} declares supports_batching=False")
        victim_seed, survivor_seed = self.seed + 30, self.seed + 40
        victim_events: list[ProgressEvent] = []
        batches = model_engine.stats()["batches_executed"]
        with held_worker(model_engine, self.request(survivor_seed, **self.runtime_params())) as survivor_solo:
            victim = model_engine.submit(self.request(victim_seed, **self.runtime_params()),
                                         on_event=victim_events.append)
            victim.add_listener(lambda e: victim.cancel() if e.phase == "denoise" and e.step == 1 else None,
                                replay=False)
            survivor = model_engine.submit(self.request(survivor_seed, **self.runtime_params()))
        expected = survivor_solo.result(0)
        outputs = survivor.result(300)
        victim.wait(300)
        assert model_engine.stats()["batches_executed"] - batches == 2, "victim and survivor did not share a batch"
        assert victim.status == "cancelled", f"the cancelled job ended {victim.status!r}"
        assert max(e.step for e in victim_events if e.phase == "denoise") == 1, "the victim went on after cancel"
        assert_close_outputs(outputs, expected, self.batch_max_abs_diff, self.batch_audio_atol,
                             "survivor of a batch with a cancelled request vs its solo run")

    # ------------------------------------------------------------------ attention selection
    def test_forced_attention_backend_is_used(self, model_engine: Engine, model_settings: Settings) -> None:
        """A model either runs its attention through the backend omnicore selects (forcing a backend makes the
        model call it), or declares ``honours_attention_backend=False`` and then forcing one is refused."""
        settings = Settings(cache_dir=model_settings.cache_dir, attention_backend=SPY_BACKEND)
        host = self.make_host(settings)
        record = host.add_plugin(SpyAttentionPlugin(host.attention_backends.get("sdpa")), "omnicore-conformance-spy")
        assert record.status == "loaded", record.error
        from ..engine.api import Engine

        if not getattr(model_engine.spec.capabilities, "honours_attention_backend", True):
            with pytest.raises(UnsupportedFeature) as info:
                Engine(self.model, host=host, settings=settings, **self.engine_options).close()
            assert "attention" in info.value.feature, f"the refusal names {info.value.feature!r}, not attention"
            return
        engine = Engine(self.model, host=host, settings=settings, **self.engine_options)
        try:
            before = spy_calls()
            self.run(engine)
            assert spy_calls() > before, (
                f"with --attention-backend {SPY_BACKEND} the model never called it: route attention through "
                "LoadOptions.attention, or declare ModelCapabilities(honours_attention_backend=False)")
        finally:
            engine.close()
