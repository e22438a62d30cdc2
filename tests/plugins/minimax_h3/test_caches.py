"""Cache methods and offload on the tiny MiniMax-H3 presets through the engine.

- ``adaln_schedule``: the exact-schedule AdaLN cache is built from the batch's known sigmas (every step's distinct
  timesteps computed on the host before the loop), gives bit-identical outputs, reuses the tables for the same
  schedule and rebuilds them for another, and with ``offload_weights`` frees every projection's weights;
- ``--offload layerwise`` with the cache: the block hooks leave ``adaln_proj.linear.*`` to the cache;
- ``teacache``: FL2VA calibration (threshold 0.17 by default), refused on a Ref2VA-only deployment, and on a
  combined one Ref2VA requests run uncached (and it is logged)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.hookspecs import hookimpl
from omnicore.module_hooks import get_hook
from omnicore.offload.layerwise import HOOK_NAME as LAYERWISE_HOOK
from omnicore.plugin_host.host import PluginHost

ADALN = ("adaln_schedule", {"offload_weights": True})
PARAMS = {"num_inference_steps": 3, "height": 64, "width": 64, "duration": 4.0, "seed": 5,
          "extra": {"aspect_ratio": "1:1"}}


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    return Settings(cache_dir=str(tmp_path_factory.mktemp("cache")))


def engine(settings, model="tiny:minimax-h3", **options):
    return Engine(model, host=PluginHost(settings), settings=settings, **options)


def _storage(params) -> int:
    return sum(p.untyped_storage().nbytes() for p in params)


class Probe:
    """Storage bytes of the DiT's parameter groups at denoise step 1 (between steps 0 and 1 of the loop)."""

    def __init__(self, dit) -> None:
        self.dit = dit
        self.seen: dict[str, int] = {}

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline, state, step):
        if step == 1 and not self.seen:
            self.seen = {
                "block1": _storage(p for n, p in self.dit.blocks[1].named_parameters()
                                   if not n.startswith("adaln_proj")),
                "adaln": _storage(p for proj in self.dit.adaln.projections for p in proj.parameters()),
            }
        return (yield)


def probed_run(eng, **params):
    probe = Probe(eng.pipeline.transformer)
    eng.host.add_plugin(probe, "h3-probe")
    try:
        out = eng.generate("rain on a tin roof", **{**PARAMS, **params})
    finally:
        eng.host.pm.unregister(probe)
    return out, probe.seen


@pytest.fixture(scope="module")
def reference(settings):
    with engine(settings) as eng:
        return eng.generate("rain on a tin roof", **PARAMS)[0]


def same(a, b) -> bool:
    return np.array_equal(a.frames, b.frames) and np.array_equal(a.audio, b.audio)


def test_adaln_cache_is_exact_reuses_and_rebuilds(settings, reference):
    with engine(settings, cache_methods=[ADALN]) as eng:
        controller = eng.pipeline.adaln_schedule
        (out,), seen = probed_run(eng)
        assert same(out, reference)
        first = controller.cache
        assert first is not None and first.steps == 3 and first.offloaded_projection_bytes > 0
        assert first.offloaded_projection_bytes == first.projection_bytes > first.table_bytes
        assert seen["adaln"] == 0 and all(p.offloaded for p in controller.projections)
        assert seen["block1"] > 0  # only the projections left
        assert same(eng.generate("rain on a tin roof", **PARAMS)[0], reference)
        assert controller.cache is first  # same schedule: the same tables, no rebuild
        eng.generate("rain on a tin roof", **{**PARAMS, "num_inference_steps": 4})
        assert controller.cache is not first and controller.cache.steps == 4  # new schedule: rebuilt
        projections = controller.projections
    assert all(not p.offloaded and p.table is None for p in projections)  # close() restored the weights


def test_adaln_cache_with_keyframes_has_a_third_timestep(settings, tmp_path):
    from PIL import Image

    path = tmp_path / "first.png"
    Image.fromarray(np.full((64, 64, 3), 120, np.uint8)).save(path)
    from omnicore.engine.request import MediaInput

    params = {**PARAMS, "inputs": (MediaInput("image", "first_frame", str(path)),)}
    with engine(settings) as eng:
        plain = eng.generate("rain on a tin roof", **params)[0]
    with engine(settings, cache_methods=[ADALN]) as eng:
        out = eng.generate("rain on a tin roof", **params)[0]
        assert eng.pipeline.adaln_schedule.cache.max_unique_timesteps == 3  # video, audio, anchor 0.999
    assert same(out, plain)


def test_layerwise_offload_leaves_projection_weights_to_the_cache(settings, reference):
    with engine(settings, offload="layerwise") as eng:
        hook = get_hook(eng.pipeline.transformer.blocks[0], LAYERWISE_HOOK)
        assert any(n.startswith("adaln_proj.linear.") for n in hook.owned)  # no cache: the block owns them
        assert same(eng.generate("rain on a tin roof", **PARAMS)[0], reference)
    with engine(settings, offload="layerwise", cache_methods=[ADALN]) as eng:
        hook = get_hook(eng.pipeline.transformer.blocks[0], LAYERWISE_HOOK)
        assert hook.owned and not any(n.startswith("adaln_proj.linear.") for n in hook.owned | hook.next_owned)
        (out,), seen = probed_run(eng)
        assert same(out, reference)
        assert seen["block1"] == 0  # between steps the block hooks keep block 1 off the device
        assert seen["adaln"] == 0  # and the cache, not the hooks, freed the projection weights


def test_teacache_uses_the_fl2va_calibration(settings, reference):
    with engine(settings, cache_methods=["teacache"]) as eng:
        (handle,) = eng.cache_handles
        assert handle.threshold == 0.17 and handle.coefficients[0] == pytest.approx(2283.704065852778)
        eng.generate("rain on a tin roof", **PARAMS)
    with engine(settings, cache_methods=[("teacache", {"rel_l1_thresh": 1e9})]) as eng:
        out = eng.generate("rain on a tin roof", **{**PARAMS, "num_inference_steps": 4})[0]
        stats = eng.cache_handles[0].last_stats
        assert stats.reused and 0 in stats.computed and 3 in stats.computed
        assert out.frames.shape == reference.frames.shape and np.isfinite(out.audio).all()


def test_teacache_and_adaln_cache_together_equal_teacache_alone(settings):
    runs = []
    for methods in (["teacache"], ["teacache", ADALN]):
        with engine(settings, cache_methods=[m if isinstance(m, tuple) else (m, {"rel_l1_thresh": 0.5})
                                             if m == "teacache" else m for m in methods]) as eng:
            runs.append((eng.generate("rain on a tin roof", **{**PARAMS, "num_inference_steps": 5})[0],
                         list(eng.cache_handles[0].last_stats.reused)))
    (a, reused_a), (b, reused_b) = runs
    assert reused_a == reused_b and same(a, b)


def test_ref2va_only_deployment_refuses_teacache(settings):
    with pytest.raises(Exception, match="FL2VA partition; Ref2VA TeaCache has not been calibrated"):
        engine(settings, "tiny:minimax-h3-ref2va", cache_methods=["teacache"])


def test_combined_deployment_runs_ref2va_uncached(combined, caplog):
    """On a combined deployment the adapter is created (with a warning) and Ref2VA batches always compute."""
    from _h3_helpers import image, reference, request
    from omnicore.cache.teacache import TeaCacheConfig, apply_teacache

    host = PluginHost(Settings(), autoload=False)
    combined.host = host
    with caplog.at_level(logging.INFO, logger="omni_minimax_h3"):
        handle = apply_teacache(combined, TeaCacheConfig(rel_l1_thresh=1e9))
        try:
            prepared = combined.preprocess(request(num_inference_steps=4, extra={},
                                                   inputs=(reference("image", image(320, 256)),)))
            state = combined.encode([prepared])
            for step in range(state.num_steps):
                state = host.pm.hook.omnicore_denoise(pipeline=combined, state=state, step=step)
            stats = handle.stats(state)
            assert stats.computed == [0, 1, 2, 3] and not stats.reused
            t2va = combined.encode([combined.preprocess(request(num_inference_steps=4))])
            for step in range(t2va.num_steps):
                t2va = host.pm.hook.omnicore_denoise(pipeline=combined, state=t2va, step=step)
            assert handle.stats(t2va).reused  # the FL2VA DiT's requests do use it
        finally:
            handle.remove()
            combined.host = None
    assert "Ref2VA requests on this deployment run without TeaCache" in caplog.text
    assert "runs without TeaCache" in caplog.text


def test_combined_deployment_keeps_one_table_set_per_dit_when_tasks_alternate(combined, monkeypatch):
    """Alternating t2va (FL2VA DiT) and ref2va (Ref2VA DiT) batches build each DiT's tables once: the single
    controller the core's method holds used to be the FL2VA DiT's, so every Ref2VA batch rebuilt (and evicted) the
    FL2VA tables and every FL2VA batch rebuilt them again (4 builds here, and Ref2VA always ran direct). Outputs
    stay bit-identical to uncached runs."""
    from _h3_helpers import image, reference, request, run
    from omnicore.cache.adaln_schedule import apply_adaln_schedule

    ref2va = request(num_inference_steps=2, extra={}, inputs=(reference("image", image(320, 256)),))
    t2va = request(num_inference_steps=2)
    _, (plain_ref,) = run(combined, ref2va)
    _, (plain_t2va,) = run(combined, t2va)
    builds = {"fl2va": 0, "ref2va": 0}
    for part, dit in combined.transformers.items():
        original = dit.adaln._build

        def counted(*args, _part=part, _original=original, **kwargs):
            builds[_part] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(dit.adaln, "_build", counted)
    host = PluginHost(Settings(), autoload=False)
    combined.host = host
    handle = apply_adaln_schedule(combined, {"offload_weights": True})
    try:
        def hooked(req):
            state = combined.encode([combined.preprocess(req)])
            for step in range(state.num_steps):
                state = host.pm.hook.omnicore_denoise(pipeline=combined, state=state, step=step)
            return combined.decode(state)[0]

        for _ in range(2):
            assert same(hooked(t2va), plain_t2va)
            assert same(hooked(ref2va), plain_ref)
        assert builds == {"fl2va": 1, "ref2va": 1}
        fl2va_cache, ref2va_cache = combined.transformer.adaln.cache, combined.transformer_ref.adaln.cache
        assert fl2va_cache is not None and ref2va_cache is not None and fl2va_cache.key != ref2va_cache.key
        assert fl2va_cache.offloaded_projection_bytes > 0 and ref2va_cache.offloaded_projection_bytes > 0
    finally:
        handle.remove()
        combined.host = None
    assert combined.transformer.adaln.cache is None and combined.transformer_ref.adaln.cache is None
    assert all(not p.offloaded for p in combined.adaln_schedule.projections)  # remove() restored both DiTs


def test_model_offload_is_exact_and_frees_the_dit_between_forwards(settings, reference):
    with engine(settings, offload="model", cache_methods=[ADALN]) as eng:
        out = eng.generate("rain on a tin roof", **PARAMS)[0]
        assert same(out, reference)
        assert _storage(p for n, p in eng.pipeline.transformer.named_parameters() if "adaln_proj" not in n) == 0


def test_adaln_offload_falls_back_to_direct_when_tables_outgrow_the_weights(settings):
    """Tables grow with the steps, the weights do not: at 3 steps they are smaller (offloaded, see above), at 24
    steps of a t2va request larger, so with ``offload_weights`` that request runs the direct projections."""
    with engine(settings, cache_methods=[ADALN]) as eng:
        eng.generate("rain on a tin roof", **PARAMS)
        small = eng.pipeline.adaln_schedule.cache
        per_step = small.table_bytes / small.steps
        steps = 24
        assert steps * per_step >= small.projection_bytes  # this schedule's tables would not save anything
        out = eng.generate("rain on a tin roof", **{**PARAMS, "num_inference_steps": steps})[0]
        controller = eng.pipeline.adaln_schedule
        assert controller.cache is None and all(p.table is None and not p.offloaded for p in controller.projections)
    with engine(settings) as eng:
        plain = eng.generate("rain on a tin roof", **{**PARAMS, "num_inference_steps": steps})[0]
    assert same(out, plain)
