"""Acceptance of several models per server: ``omnicore serve tiny:lingbot tiny:minimax-h3 tiny:hunyuan-image3
--memory-budget <room for two>`` as a real process serves all three through the ``openai`` SDK and the video jobs
API, and ``/v1/models`` shows the states change as models are swapped. Tiny presets: the outputs are noise."""

from __future__ import annotations

import base64
import io
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import httpx
import pytest

for _plugin in ("omni_lingbot", "omni_minimax_h3", "omni_hunyuan"):
    pytest.importorskip(_plugin, reason=f"{_plugin} is not installed")
pytestmark = pytest.mark.slow
MODELS = ("tiny:lingbot", "tiny:minimax-h3", "tiny:hunyuan-image3")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sizes(cache: Path) -> dict[str, int]:
    """Each preset's weight files (the pool's estimate before a model was loaded), building the presets."""
    from omnicore.config import Settings
    from omnicore.engine.loading import resolve_model
    from omnicore.plugin_host.host import PluginHost
    from omnicore.pool.memory import checkpoint_bytes

    settings = Settings(cache_dir=str(cache))
    host = PluginHost(settings)
    return {m[5:]: checkpoint_bytes(resolve_model(m, host, settings).path) for m in MODELS}


def _states(url: str) -> dict[str, str]:
    return {m["id"]: m["omnicore"]["state"] for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}


def test_three_tiny_models_in_a_budget_for_two(tmp_path):
    openai = pytest.importorskip("openai")
    cache = tmp_path / "cache"
    sizes = _sizes(cache)
    two_largest = sum(sorted(sizes.values())[-2:])
    budget = two_largest + min(sizes.values()) // 2  # any two fit, all three do not
    assert budget < sum(sizes.values())
    port = _free_port()
    exe = Path(sys.executable).with_name("omnicore")
    env = dict(os.environ, OMNICORE_CACHE=str(cache), OMNICORE_SHUTDOWN_GRACE_S="30")
    proc = subprocess.Popen([str(exe), "serve", *MODELS, "--memory-budget", str(budget), "--port", str(port),
                             "--state-dir", str(tmp_path / "state")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert _states(url) == {"lingbot": "loaded", "minimax-h3": "loaded", "hunyuan-image3": "unloaded"}
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == ["lingbot", "minimax-h3", "hunyuan-image3"]

        img = client.images.generate(model="hunyuan-image3", prompt="a lighthouse at dusk", size="256x256",
                                     extra_body={"num_inference_steps": 2, "seed": 1})
        from PIL import Image

        assert Image.open(io.BytesIO(base64.b64decode(img.data[0].b64_json))).size == (256, 256)
        after_image = _states(url)
        assert after_image["hunyuan-image3"] == "loaded" and list(after_image.values()).count("loaded") == 2
        assert "offloaded" in after_image.values()

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the SDK marks the videos API deprecated
            videos = {name: client.videos.create(model=name, prompt="waves on a beach", extra_body=extra)
                      for name, extra in (("lingbot", {"num_inference_steps": 2, "num_frames": 5, "seed": 2}),
                                          ("minimax-h3", {"num_inference_steps": 2, "seed": 3, "seconds": "4",
                                                         "model_params": {"aspect_ratio": "1:1"}}))}
            for name, video in videos.items():
                for _ in range(3000):
                    video = client.videos.retrieve(video.id)
                    if video.status in ("completed", "failed"):
                        break
                    time.sleep(0.1)
                assert video.status == "completed", (name, video)
                data = client.videos.download_content(video.id).read()
                assert data[4:8] == b"ftyp", name
        final = _states(url)
        assert final["lingbot"] == "loaded" and final["minimax-h3"] == "loaded", final
        assert final["hunyuan-image3"] == "offloaded", final
        metrics = httpx.get(url + "/metrics", timeout=30).text
        assert 'omnicore_model_swaps_total{action="offload",model="hunyuan-image3"} 1.0' in metrics
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Traceback" not in out, out
