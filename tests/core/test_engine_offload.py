"""``Engine(offload=...)`` and the ``adaln_schedule`` cache method end to end, on the test-only ``toy-adaln``
model (blocks with AdaLN projections; declares block_loop, offload_modules and an AdaLN schedule).

Reference for every output: the same engine settings with no offload and no cache (bit-identical bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnicore.engine.api import Engine, make_request
from omnicore.errors import ConfigError, UnsupportedFeature
from omnicore.module_hooks import get_hook
from omnicore.hookspecs import hookimpl
from omnicore.offload.layerwise import HOOK_NAME as LAYERWISE_HOOK
from safetensors.torch import load_file

ADALN = ("adaln_schedule", {"offload_weights": True})
REQUESTS = ({"seed": 3, "num_frames": 3, "guidance_scale": 2.0}, {"seed": 4, "num_inference_steps": 5})


@pytest.fixture
def host(toy_settings):
    from toy import TOY_ADALN_SPEC, ToyPlugin, toy_host

    h = toy_host(toy_settings)
    h.add_plugin(ToyPlugin(TOY_ADALN_SPEC), "toy-adaln")
    return h


def _run(host, settings, **options):
    with Engine("tiny:toy-adaln", host=host, settings=settings, **options) as engine:
        return [engine.generate("a lamp", **params)[0].frames for params in REQUESTS]


@pytest.fixture
def reference(host, toy_settings):
    return _run(host, toy_settings)


def _storage(params) -> int:
    return sum(p.untyped_storage().nbytes() for p in params)


class Probe:
    """Records, at denoise step 1, the storage bytes of the transformer's parameter groups."""

    def __init__(self, transformer) -> None:
        self.tr = transformer
        self.seen: dict[str, int] = {}

    @hookimpl(wrapper=True)
    def omnicore_denoise(self, pipeline, state, step):
        if step == 1 and not self.seen:
            tr = self.tr
            self.seen = {
                "block1": _storage(p for n, p in tr.blocks[1].named_parameters() if not n.startswith("adaln_proj")),
                "adaln": _storage(p for proj in tr.adaln.projections for p in proj.parameters()),
                "time_proj": _storage(tr.time_proj.parameters()),
            }
        return (yield)


def _probe(engine: Engine) -> dict[str, int]:
    probe = Probe(engine.pipeline.model.transformer)
    engine.host.add_plugin(probe, "probe")
    try:
        engine.generate("probe", seed=0)
    finally:
        engine.host.pm.unregister(probe)
    return probe.seen


@pytest.mark.parametrize("offload", ["layerwise", "model"])
@pytest.mark.parametrize("cached", [False, True], ids=["plain", "adaln"])
def test_offload_and_adaln_cache_give_identical_bytes(host, toy_settings, reference, offload, cached):
    options = {"offload": offload, "cache_methods": [ADALN] if cached else []}
    assert all(np.array_equal(a, b) for a, b in zip(_run(host, toy_settings, **options), reference))


def test_adaln_cache_alone_is_exact_and_frees_projection_storage(host, toy_settings, reference):
    assert all(np.array_equal(a, b) for a, b in zip(_run(host, toy_settings, cache_methods=[ADALN]), reference))
    with Engine("tiny:toy-adaln", host=host, settings=toy_settings, cache_methods=[ADALN]) as engine:
        seen = _probe(engine)
        projections = engine.pipeline.adaln_schedule.projections
        assert seen["adaln"] == 0 and all(p.offloaded for p in projections)
        assert seen["block1"] > 0  # no offload asked: the rest stays resident
    assert all(not p.offloaded and p.table is None for p in projections)  # close() restored them


def test_layerwise_offload_releases_blocks_and_leaves_cache_owned_weights_to_the_cache(host, toy_settings):
    with Engine("tiny:toy-adaln", host=host, settings=toy_settings, offload="layerwise") as engine:
        tr = engine.pipeline.model.transformer
        hook = get_hook(tr.blocks[0], LAYERWISE_HOOK)
        assert any(n.startswith("adaln_proj.linear.") for n in hook.owned)  # no cache: the block owns them
    with Engine("tiny:toy-adaln", host=host, settings=toy_settings, offload="layerwise",
                cache_methods=[ADALN]) as engine:
        tr = engine.pipeline.model.transformer
        hook = get_hook(tr.blocks[0], LAYERWISE_HOOK)
        assert hook.owned == hook.next_owned == {"conv.weight", "conv.bias"}
        seen = _probe(engine)
        assert seen["block1"] == 0  # between steps only block 0 is on the device
        assert seen["adaln"] == 0  # the cache, not the block hooks, offloaded the projection weights
        assert seen["time_proj"] > 0


def test_model_offload_keeps_the_transformer_off_the_device_between_forwards(host, toy_settings):
    with Engine("tiny:toy-adaln", host=host, settings=toy_settings, offload="model",
                cache_methods=[ADALN]) as engine:
        seen = _probe(engine)
        assert seen["block1"] == 0 and seen["time_proj"] == 0 and seen["adaln"] == 0
        model = engine.pipeline.model
        assert _storage(model.embed.parameters()) > 0 and _storage(model.decoder.parameters()) > 0


@pytest.mark.parametrize("offload", ["layerwise", "model"])
def test_close_puts_every_weight_back_exactly(host, toy_settings, offload):
    with Engine("tiny:toy-adaln", host=host, settings=toy_settings, offload=offload,
                cache_methods=[ADALN]) as engine:
        engine.generate("x", seed=1)
        model = engine.pipeline.model
        checkpoint = load_file(str(engine.resolved.path / "model.safetensors"))
    state = model.state_dict()
    assert set(state) == set(checkpoint)
    assert all(torch.equal(state[k], v) for k, v in checkpoint.items())


def test_models_must_declare_what_offload_needs(toy_host, toy_settings):
    for mode, what in (("layerwise", "block_loop"), ("model", "offload_modules")):
        with pytest.raises(UnsupportedFeature, match=what):
            Engine("tiny:toy", host=toy_host, settings=toy_settings, offload=mode)


def test_a_failing_cache_method_undoes_earlier_ones_and_the_offload(host, toy_settings):
    before = {name for name, _ in host.pm.list_name_plugin()}
    with pytest.raises(ConfigError, match="unknown option"):
        Engine("tiny:toy-adaln", host=host, settings=toy_settings, offload="model",
               cache_methods=["teacache", ("adaln_schedule", {"offload_weight": True})])
    assert {name for name, _ in host.pm.list_name_plugin()} == before


def test_mutually_exclusive_cache_methods_are_rejected_before_loading(host, toy_settings, monkeypatch):
    from omnicore.engine import api

    monkeypatch.setattr(api, "load_pipeline", lambda *a: pytest.fail("loaded despite a bad configuration"))
    with pytest.raises(UnsupportedFeature, match="mutually exclusive"):
        Engine("tiny:toy-adaln", host=host, settings=toy_settings, cache_methods=["teacache", "first_block_cache"])


def test_reference_image_is_loaded_once_and_conditions_the_output(host, toy_settings, tmp_path):
    from PIL import Image

    path = tmp_path / "ref.png"
    Image.new("RGB", (16, 16), (250, 250, 250)).save(path)
    with Engine("tiny:toy-adaln", host=host, settings=toy_settings) as engine:
        job = engine.submit(make_request("a lamp", images=[str(path)], seed=2))
        [with_ref] = job.result(30)
        [without] = engine.generate("a lamp", seed=2)
        assert isinstance(job.request.images[0], np.ndarray) and job.request.images[0].shape == (16, 16, 3)
        assert not np.array_equal(with_ref.frames, without.frames)
        with pytest.raises(Exception, match="at most 1 reference"):
            engine.generate("a lamp", images=[str(path), str(path)], seed=2)
