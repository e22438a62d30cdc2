"""The adapter through omnicore's other surfaces: checkpoint claiming (dedicated plugins win), the CLI,
``omnicore serve`` with the openai SDK and the video jobs API (cancel), offload, and refused caches.

The checkpoints are directories written by diffusers' ``save_pretrained`` (``omni_diffusers.presets``), served
by path, the way a user serves ``./tiny-flux``.
"""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _diffusers_helpers import make_engine
from PIL import Image

PROMPT = "a red fox in the snow"


@pytest.fixture(scope="module")
def flux_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_diffusers.presets import build_flux

    target = tmp_path_factory.mktemp("tiny-flux") / "tiny-flux"
    build_flux(target)
    return target


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omni_diffusers.presets import build_wan

    target = tmp_path_factory.mktemp("tiny-wan") / "tiny-wan"
    build_wan(target)
    return target


def _stock(path: Path, prompt: str, seed: int, **kwargs: Any) -> np.ndarray:
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(str(path))
    pipe.set_progress_bar_config(disable=True)
    images = pipe(prompt, generator=torch.Generator().manual_seed(seed), max_sequence_length=32, **kwargs).images
    return np.asarray(images[0])


def _env(tmp: Path, extra_path: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    env["OMNICORE_CACHE"] = str(tmp / "cache")
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    return env


# ------------------------------------------------------------------ claiming
def test_a_save_pretrained_directory_is_claimed_by_the_adapter(flux_dir: Path, settings: Any,
                                                                tmp_path: Path) -> None:
    from omnicore.engine.loading import resolve_model
    from omnicore.errors import InvalidRequest
    from omnicore.testing import add_loaded, isolated_host

    host = isolated_host(settings)
    add_loaded(host, "omni_diffusers.plugin")
    assert resolve_model(flux_dir, host, settings).spec.name == "diffusers"
    other = tmp_path / "not-diffusers"
    other.mkdir()
    (other / "model_index.json").write_text('{"_class_name": "MyOwnPipeline", "_diffusers_version": "0.42.1"}')
    with pytest.raises(InvalidRequest, match="MyOwnPipeline"):  # not a class diffusers exports
        resolve_model(other, host, settings)


FAKE_PLUGIN = '''
from omnicore.plugin import ModelSpec, hookimpl

@hookimpl
def omnicore_register_models(register):
    register(ModelSpec(name="dedicated-flux", impl="fake_dedicated:Pipeline", aliases=("fluxpipeline",)))
    register(ModelSpec(name="dedicated-wan", impl="fake_dedicated:Pipeline", detect="fake_dedicated:detect"))

def detect(path):
    import json, pathlib
    index = pathlib.Path(path) / "model_index.json"
    return index.is_file() and json.loads(index.read_text()).get("_class_name") == "WanPipeline"

class Pipeline:
    pass
'''


def test_dedicated_plugins_win_over_the_adapter(flux_dir: Path, wan_dir: Path, tmp_path: Path) -> None:
    """An installed plugin that claims FluxPipeline by alias and WanPipeline by detector gets those
    directories, whichever order the host loads the plugins in; without it the adapter claims them."""
    site = tmp_path / "site"
    (site / "fake_dedicated-0.1.dist-info").mkdir(parents=True)
    (site / "fake_dedicated.py").write_text(textwrap.dedent(FAKE_PLUGIN))
    (site / "fake_dedicated-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-dedicated\n"
                                                                    "Version: 0.1\n")
    (site / "fake_dedicated-0.1.dist-info" / "entry_points.txt").write_text(
        "[omnicore]\nfake_dedicated = fake_dedicated\n")
    script = ("import sys; from omnicore.plugin_host import PluginHost; "  # settings from the environment
              "from omnicore.engine.loading import resolve_model; h = PluginHost(); s = h.settings; "
              "print([resolve_model(p, h, s).spec.name for p in sys.argv[1:]])")
    args = [sys.executable, "-c", script, str(flux_dir), str(wan_dir)]
    with_it = subprocess.run(args, env=_env(tmp_path, site), capture_output=True, text=True, timeout=300)
    assert with_it.returncode == 0, with_it.stderr
    assert with_it.stdout.strip().splitlines()[-1] == "['dedicated-flux', 'dedicated-wan']", with_it.stdout
    for env in (_env(tmp_path), {**_env(tmp_path, site), "OMNICORE_DISABLE_PLUGINS": "fake_dedicated"}):
        without = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        assert without.returncode == 0, without.stderr  # not installed, or disabled: the adapter claims both
        assert without.stdout.strip().splitlines()[-1] == "['diffusers', 'diffusers']", without.stdout


def test_plugins_and_models_commands_list_the_adapter(tmp_path: Path) -> None:
    run = lambda *a: subprocess.run([sys.executable, "-m", "omnicore.cli.main", *a], env=_env(tmp_path),  # noqa: E731
                                    capture_output=True, text=True, timeout=300)
    plugins, models = run("plugins"), run("models")
    assert plugins.returncode == 0 and "diffusers" in plugins.stdout, plugins.stdout + plugins.stderr
    assert models.returncode == 0, models.stderr
    assert "diffusers  (diffusers)" in models.stdout and "tiny:diffusers-flux" in models.stdout, models.stdout


@pytest.mark.slow
def test_models_describes_one_checkpoint_from_its_own_signature(flux_dir: Path, tmp_path: Path) -> None:
    """``omnicore models DIR``: the card of that checkpoint (the generic spec narrowed to its pipeline class), and a
    directory that is no checkpoint is one error line while the others are still described."""
    import json

    img2img = tmp_path / "img2img"
    from omni_diffusers.presets import build_flux_img2img

    build_flux_img2img(img2img)
    code = subprocess.run([sys.executable, "-m", "omnicore.cli.main", "models", "--json", str(flux_dir), str(img2img),
                           str(tmp_path / "nothing")], env=_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert code.returncode == 1 and "nothing" in code.stderr, code.stderr
    cards = {Path(c["checkpoint"]["path"]).name: c for c in json.loads(code.stdout)["models"]}
    assert cards[flux_dir.name]["modes"] == ["t2i"] and cards[flux_dir.name]["inputs"] == []
    assert cards["img2img"]["modes"] == ["i2i"] and [r["role"] for r in cards["img2img"]["inputs"]] == ["reference"]
    assert "FluxImg2ImgPipeline" in cards["img2img"]["description"]
    assert "strength" in [f["name"] for f in cards["img2img"]["request_fields"]]


# ------------------------------------------------------------------ the CLI
@pytest.mark.slow
def test_cli_generate_equals_the_stock_pipeline(flux_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "fox.png"
    done = subprocess.run([sys.executable, "-m", "omnicore.cli.main", "generate", str(flux_dir), PROMPT, "-o",
                           str(out), "--seed", "5", "--height", "32", "--width", "32", "--steps", "2",
                           "--no-progress"], env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    expected = _stock(flux_dir, PROMPT, 5, height=32, width=32, num_inference_steps=2, guidance_scale=3.5)
    assert np.array_equal(np.asarray(Image.open(out).convert("RGB")), expected)


# ------------------------------------------------------------------ omnicore serve
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Server:
    def __init__(self, model: Path, tmp: Path) -> None:
        import httpx

        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "omnicore.cli.main", "serve", str(model), "--port", str(self.port),
               "--state-dir", str(tmp / "state")]
        self.log = tmp / "serve.log"
        self.proc = subprocess.Popen(cmd, env=_env(tmp), stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, "server not up in 300 s:\n" + self.log.read_text()
            try:
                reply = httpx.get(self.url + "/v1/models", timeout=5)
                if reply.status_code == 200:
                    self.models = reply.json()["data"]
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.slow
def test_serve_images_with_the_openai_sdk_equal_the_stock_pipeline(flux_dir: Path, tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    server = _Server(flux_dir, tmp_path)
    try:
        [card] = server.models
        info = card["omnicore"]
        assert info["modes"] == ["t2i"] and "fluxpipeline" in info["aliases"], info  # from the loaded pipeline
        assert "true_cfg_scale" in {f["name"] for f in info["model_params"]}, info["model_params"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        resp = client.images.generate(model=card["id"], prompt=PROMPT, n=2, size="32x32",
                                      extra_body={"seed": 9, "num_inference_steps": 2})
    finally:
        server.close()
    got = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json))).convert("RGB")) for d in resp.data]
    for i, image in enumerate(got):  # output i uses seed + i
        expected = _stock(flux_dir, PROMPT, 9 + i, height=32, width=32, num_inference_steps=2, guidance_scale=3.5)
        assert np.array_equal(image, expected), f"image {i} differs from the stock pipeline"


def _sse(lines: Any) -> Any:
    """(event type, data) pairs of a server-sent event stream."""
    import json

    kind = None
    for line in lines:
        if line.startswith("event: "):
            kind = line[len("event: "):]
        elif line.startswith("data: "):
            yield kind, json.loads(line[len("data: "):])


def _cancelled_jobs(url: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("omnicore_jobs_total{") and 'status="cancelled"' in line)


@pytest.mark.slow
def test_serve_a_save_pretrained_directory_streams_progress_and_a_disconnect_cancels(flux_dir: Path,
                                                                                     tmp_path: Path) -> None:
    """``omnicore serve ./tiny-flux`` (acceptance): ``stream: true`` on /v1/images/generations sends one denoise
    progress event per step, monotone, then the image, equal to the stock pipeline; a client that disconnects
    after the first step cancels its job (counted on /metrics) and the server serves the next request."""
    import httpx

    server = _Server(flux_dir, tmp_path)
    try:
        body = {"prompt": PROMPT, "size": "32x32", "seed": 4, "num_inference_steps": 4, "stream": True}
        with httpx.stream("POST", server.url + "/v1/images/generations", json=body, timeout=120) as reply:
            reply.raise_for_status()
            events = list(_sse(reply.iter_lines()))
        steps = [(d["step"], d["total_steps"]) for k, d in events
                 if k == "image_generation.progress" and d["phase"] == "denoise"]
        assert steps == [(i, 4) for i in range(1, 5)], events
        progress = [d["progress"] for k, d in events if k == "image_generation.progress"]
        assert progress == sorted(progress)
        [done] = [d for k, d in events if k == "image_generation.completed"]
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(done["b64_json"]))).convert("RGB"))
        assert np.array_equal(image, _stock(flux_dir, PROMPT, 4, height=32, width=32, num_inference_steps=4,
                                            guidance_scale=3.5))

        before = _cancelled_jobs(server.url)
        long = {**body, "num_inference_steps": 200, "seed": 5}
        with httpx.stream("POST", server.url + "/v1/images/generations", json=long, timeout=120) as reply:
            for kind, data in _sse(reply.iter_lines()):
                if kind == "image_generation.progress" and data["phase"] == "denoise" and data["step"] >= 1:
                    break  # leaving the block closes the connection mid-request
        deadline = time.monotonic() + 120
        while _cancelled_jobs(server.url) < before + 1:
            assert time.monotonic() < deadline, "the disconnected request was not cancelled"
            time.sleep(0.2)
        again = httpx.post(server.url + "/v1/images/generations", timeout=120,
                           json={"prompt": PROMPT, "size": "32x32", "seed": 6, "num_inference_steps": 2})
        assert again.status_code == 200 and len(again.json()["data"]) == 1
    finally:
        server.close()


@pytest.mark.slow
def test_serve_video_jobs_report_steps_and_cancel(wan_dir: Path, tmp_path: Path) -> None:
    """A running Wan job reports its steps; POST /cancel stops one, DELETE stops another and deletes it (its
    record is gone), and the server serves the next job."""
    import httpx

    server = _Server(wan_dir, tmp_path)
    try:
        body = {"prompt": PROMPT, "size": "32x32", "num_frames": 5, "num_inference_steps": 200, "seed": 1}
        job = httpx.post(server.url + "/v1/videos", json=body, timeout=30).json()
        deadline = time.monotonic() + 120
        while (state := httpx.get(f"{server.url}/v1/videos/{job['id']}", timeout=10).json()).get("step") in (None, 0):
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        assert state["total_steps"] == 200 and state["status"] == "in_progress"
        httpx.post(f"{server.url}/v1/videos/{job['id']}/cancel", timeout=10).raise_for_status()
        while (state := httpx.get(f"{server.url}/v1/videos/{job['id']}", timeout=10).json())["status"] not in (
                "cancelled", "completed", "failed"):
            assert time.monotonic() < deadline, state
            time.sleep(0.2)
        assert state["status"] == "cancelled" and state["step"] < 200, state
        doomed = httpx.post(server.url + "/v1/videos", json={**body, "seed": 3}, timeout=30).json()
        while httpx.get(f"{server.url}/v1/videos/{doomed['id']}", timeout=10).json().get("step") in (None, 0):
            assert time.monotonic() < deadline, "the second job never started"
            time.sleep(0.2)
        deleted = httpx.delete(f"{server.url}/v1/videos/{doomed['id']}", timeout=60)  # DELETE = cancel + delete
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True, deleted.text
        assert httpx.get(f"{server.url}/v1/videos/{doomed['id']}", timeout=10).status_code == 404
        small = {**body, "num_inference_steps": 2, "seed": 2}
        again = httpx.post(server.url + "/v1/videos", json=small, timeout=30).json()
        while (state := httpx.get(f"{server.url}/v1/videos/{again['id']}", timeout=10).json())["status"] not in (
                "cancelled", "completed", "failed"):
            assert time.monotonic() < deadline + 120, state
            time.sleep(0.2)
        assert state["status"] == "completed", state  # the server goes on after a cancel
    finally:
        server.close()


# ------------------------------------------------------------------ offload and caches
def test_model_and_layerwise_offload_keep_the_outputs(settings: Any) -> None:
    """``--offload model`` (every component but the VAE) and ``--offload layerwise`` (every block of every
    denoiser, FLUX's double and single blocks in their order) give the same pixels; on CPU the device is the host,
    so this checks the hooks' wiring and ordering, not transfer speed."""
    from omnicore.module_hooks import HookRegistry
    from omnicore.offload.layerwise import HOOK_NAME

    outputs = []
    for mode in ("none", "model", "layerwise"):
        with make_engine("tiny:diffusers-flux", settings, offload=mode) as engine:
            [out] = engine.generate(PROMPT, seed=3)
            outputs.append(out.frames.tobytes())
            if mode == "layerwise":
                transformer = engine.pipeline.pipe.transformer
                blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
                assert engine.pipeline.offload_blocks == blocks
                registries = [HookRegistry.for_module(b, create=False) for b in blocks]
                assert all(r is not None and r.get(HOOK_NAME) is not None for r in registries)
    assert outputs[0] == outputs[1] == outputs[2]


def test_a_modular_index_without_blocks_is_refused_clearly(settings: Any, tmp_path: Path) -> None:
    """Modular pipelines are served (tests/plugins/diffusers/test_modular.py); an index diffusers cannot resolve
    to blocks is a checkpoint error naming the file."""
    from omnicore.plugin import CheckpointError

    modular = tmp_path / "modular"
    modular.mkdir()
    (modular / "modular_model_index.json").write_text('{"_class_name": "ModularPipeline", "_diffusers_version": '
                                                      '"0.42.1"}')
    with pytest.raises(CheckpointError, match="modular_model_index.json.*not a loadable modular pipeline"):
        make_engine(modular, settings).close()


def test_a_pipeline_without_step_callbacks_is_refused_at_load(settings: Any, tmp_path: Path) -> None:
    """DDPMPipeline's ``__call__`` takes no ``callback_on_step_end``: it could be neither stepped nor cancelled."""
    import diffusers
    from omnicore.errors import UnsupportedFeature

    unet = diffusers.UNet2DModel(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(4, 8),
                                 layers_per_block=1, norm_num_groups=4, down_block_types=("DownBlock2D",) * 2,
                                 up_block_types=("UpBlock2D",) * 2)
    diffusers.DDPMPipeline(unet=unet, scheduler=diffusers.DDPMScheduler()).save_pretrained(str(tmp_path / "ddpm"))
    with pytest.raises(UnsupportedFeature, match="callback_on_step_end"):
        make_engine(tmp_path / "ddpm", settings).close()
