"""HunyuanImage-3 over real HTTP (uvicorn on loopback): a size the client set is used as given or refused naming the
nearest sizes, the pixel cap applies to the resolved size, and an unknown ``model_params`` field is a 400
``unknown_parameter`` (issue 28 item 9; no silent changes: unknown fields are rejected).

The server serves the micro checkpoint (the tiny preset's architecture at image base 64) so a 64x64 image takes
well under a second on CPU.
"""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import httpx
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "server"))  # _server_helpers


@pytest.fixture(scope="module")
def server(micro_dir, tmp_path_factory):
    from _server_helpers import LiveServer
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost
    from omnicore.server import ServerSettings, create_app

    root = tmp_path_factory.mktemp("hunyuan-http")
    settings = Settings(cache_dir=str(root / "cache"), plugins=("hunyuan",))
    engine = Engine(str(micro_dir), host=PluginHost(settings), settings=settings)
    # a pixel cap below the default 64x64 but above the 80x48 bucket
    srv = LiveServer(create_app(engine, ServerSettings(state_dir=root / "state", max_image_pixels=64 * 64 - 1),
                                model_arg=str(micro_dir))).start()
    yield srv
    srv.stop()


def _post(server, **body):
    body = {"prompt": "a lighthouse at dusk", "num_inference_steps": 1, "seed": 1, **body}
    return httpx.post(server.url + "/v1/images/generations", json=body, timeout=60)


def _error(resp):
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]


@pytest.mark.parametrize("size", ["48x48", "4128x4128", "96x96"])
def test_a_size_that_is_not_a_bucket_is_refused_naming_the_nearest(server, size):
    err = _error(_post(server, size=size))
    assert err["param"] == "size" and err["code"] == "invalid_value"
    assert f"{size} is not one of this model's sizes" in err["message"] and "nearest: 64x64" in err["message"]


def test_a_bucket_size_is_used_as_given_and_reported(server):
    resp = _post(server, size="80x48")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["size"] == "80x48"
    assert Image.open(io.BytesIO(base64.b64decode(body["data"][0]["b64_json"]))).size == (80, 48)


def test_the_pixel_cap_applies_to_the_resolved_size(server):
    for body in ({"size": "64x64"}, {}):  # explicit, and the model default the request resolves to
        err = _error(_post(server, **body))
        assert err["code"] == "image_too_large" and "--max-image-pixels" in err["message"], err


@pytest.mark.parametrize(("params", "param"), [
    ({"foo": 1}, "model_params.foo"),
    ({"bot_task": "image", "steps": 3}, "model_params.steps"),
])
def test_unknown_model_params_are_refused(server, params, param):
    err = _error(_post(server, size="80x48", model_params=params))
    assert err["code"] == "unknown_parameter" and err["param"] == param, err
    err = _error(_post(server, size="80x48", extra_params=params))  # the alias, same rule
    assert err["code"] == "unknown_parameter" and err["param"] == param, err


def test_known_model_params_still_work(server):
    resp = _post(server, size="80x48", model_params={"bot_task": "image", "guidance_rescale": 0.5})
    assert resp.status_code == 200, resp.text
