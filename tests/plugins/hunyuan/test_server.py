"""Acceptance over HTTP: tiny:hunyuan-image3 behind real uvicorn, driven by the unmodified openai SDK."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path

import pytest
from PIL import Image

pytestmark = pytest.mark.slow
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "server"))  # _server_helpers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from _server_helpers import LiveServer
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost
    from omnicore.server import ServerSettings, create_app

    root = tmp_path_factory.mktemp("hunyuan")
    settings = Settings(cache_dir=str(root / "cache"), plugins=("hunyuan",))
    engine = Engine("tiny:hunyuan-image3", host=PluginHost(settings), settings=settings)
    srv = LiveServer(create_app(engine, ServerSettings(state_dir=root / "state"),
                                model_arg="tiny:hunyuan-image3")).start()
    yield srv
    srv.stop()


def test_openai_sdk_generate_and_edit(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["hunyuan-image3"]
    img = client.images.generate(model="tiny:hunyuan-image3", prompt="a lighthouse at dusk", size="256x256",
                                 extra_body={"num_inference_steps": 2, "seed": 1})
    pic = Image.open(io.BytesIO(base64.b64decode(img.data[0].b64_json)))
    assert pic.size == (256, 256)
    buf = io.BytesIO()
    pic.save(buf, format="PNG")
    edited = client.images.edit(model="hunyuan-image3", image=("in.png", buf.getvalue(), "image/png"),
                                prompt="make it blue", extra_body={"num_inference_steps": 2, "seed": 2})
    out = Image.open(io.BytesIO(base64.b64decode(edited.data[0].b64_json)))
    assert out.size == (256, 256)  # the edit defaults to the input image's size
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model="hunyuan-image3", prompt="x", size="1024x128")
    assert err.value.body["param"] == "size" and "resolution buckets" in err.value.body["message"]
