"""Acceptance with the first real model plugin: tiny:lingbot behind real uvicorn, driven by the openai SDK."""

from __future__ import annotations

import base64
import io
import time
import warnings

import pytest
from PIL import Image

pytest.importorskip("omni_lingbot", reason="the LingBot plugin (plugins/lingbot) is not installed")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lingbot_server(tmp_path_factory):
    from _server_helpers import LiveServer
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost
    from omnicore.server import ServerSettings, create_app

    root = tmp_path_factory.mktemp("lingbot")
    settings = Settings(cache_dir=str(root / "cache"), plugins=("lingbot",))
    engine = Engine("tiny:lingbot", host=PluginHost(settings), settings=settings)
    srv = LiveServer(create_app(engine, ServerSettings(state_dir=root / "state"), model_arg="tiny:lingbot")).start()
    yield srv
    srv.stop()


def test_openai_sdk_t2i_and_t2v_on_tiny_lingbot(lingbot_server):
    openai = pytest.importorskip("openai")
    srv = lingbot_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == ["lingbot"]
    img = client.images.generate(model="tiny:lingbot", prompt="a lighthouse at dusk",
                                 extra_body={"num_inference_steps": 2, "seed": 1})
    assert len(img.data) == 1
    pic = Image.open(io.BytesIO(base64.b64decode(img.data[0].b64_json)))
    assert pic.size[0] >= 16 and pic.size[1] >= 16
    with pytest.raises(openai.BadRequestError) as err:  # LingBot makes one output per request
        client.images.generate(model="lingbot", prompt="x", n=2)
    assert err.value.body["param"] == "n"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        video = client.videos.create(model="lingbot", prompt="waves on a beach",
                                     extra_body={"num_inference_steps": 2, "num_frames": 5, "seed": 2})
        for _ in range(1200):
            video = client.videos.retrieve(video.id)
            if video.status in ("completed", "failed"):
                break
            time.sleep(0.1)
        assert video.status == "completed", video
        data = client.videos.download_content(video.id).read()
    assert data[4:8] == b"ftyp" and len(data) > 100
