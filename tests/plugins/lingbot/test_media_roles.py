"""LingBot on the core's media roles (issue 8): its TI2V image is the ``first_frame`` role, an
image without a role takes it with identical results, other roles and kinds are refused before the model runs,
and the tiny presets serve small fast defaults while the model keeps its own."""

from __future__ import annotations

import numpy as np
import pytest
from omnicore.config import Settings
from omnicore.engine.api import Engine
from omnicore.engine.request import MediaInput
from omnicore.errors import InvalidRequest
from omnicore.plugin_host.host import PluginHost
from PIL import Image

SMALL = {"height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2, "guidance_scale": 2.0, "seed": 7,
         "output_type": "video"}


@pytest.fixture(scope="module")
def settings(tmp_path_factory):
    return Settings(cache_dir=str(tmp_path_factory.mktemp("roles-cache")), plugins=("lingbot",))


@pytest.fixture(scope="module")
def engine(settings):
    with Engine("tiny:lingbot", host=PluginHost(settings), settings=settings) as e:
        yield e


def _image(value: int = 90) -> Image.Image:
    return Image.fromarray(np.full((40, 56, 3), value, dtype=np.uint8))


def test_an_image_without_a_role_is_the_first_frame(engine):
    img = _image()
    job = engine.submit(engine_request(images=[img]))
    by_images = job.result(120)[0].frames
    assert [(m.kind, m.role) for m in job.request.inputs] == [("image", "first_frame")]
    assert job.request.plan is not None and not job.request.extra  # LingBot's preprocess planned it, extra untouched
    by_role = engine.generate("a red fox", inputs=[MediaInput("image", "first_frame", img)], **SMALL)[0].frames
    assert np.array_equal(by_images, by_role)
    t2v = engine.generate("a red fox", **SMALL)[0].frames
    assert not np.array_equal(by_role, t2v)  # the first frame conditioned the clip


def engine_request(**kw):
    from omnicore.engine.api import make_request

    return make_request("a red fox", **kw, **SMALL)


@pytest.mark.parametrize(("inputs", "field"), [
    ([MediaInput("image", "last_frame", "x.png")], "inputs[0].role"),
    ([MediaInput("image", "reference", "x.png")], "inputs[0].role"),
    ([MediaInput("video", None, "x.mp4")], "inputs[0].kind"),
    ([MediaInput("image", "first_frame", "x.png")] * 2, "inputs[1]"),
])
def test_other_roles_and_kinds_are_refused_before_preprocess(engine, inputs, field):
    with pytest.raises(InvalidRequest) as info:
        engine.generate("a red fox", inputs=inputs, **SMALL)
    assert info.value.field == field


@pytest.mark.slow
def test_tiny_presets_default_small_while_the_model_keeps_its_defaults(engine):
    from omni_lingbot.plugin import DEFAULTS, MODEL_SPEC, TINY_DEFAULTS

    assert engine.spec.defaults == TINY_DEFAULTS and MODEL_SPEC.defaults == DEFAULTS
    assert (DEFAULTS.height, DEFAULTS.width, DEFAULTS.num_frames, DEFAULTS.num_inference_steps) == (480, 480, 81, 40)
    job = engine.submit(engine_request_defaults())
    [out] = job.result(300)
    p = job.request.params
    assert (p.height, p.width, p.num_frames, p.num_inference_steps, p.guidance_scale, p.flow_shift) == \
        (48, 48, 5, 4, 6.0, 3.0)
    assert out.frames.shape == (5, 48, 48, 3)


def engine_request_defaults():
    from omnicore.engine.api import make_request

    return make_request("a red fox", output_type="video", seed=3)


def test_vae_decode_precision_other_than_fp32_is_refused_at_load(engine, settings):
    from omnicore.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        Engine("tiny:lingbot", host=PluginHost(settings), settings=settings, vae_decode_precision="bf16")
    assert info.value.name == "vae_decode_precision" and "fp32 only" in info.value.rule
