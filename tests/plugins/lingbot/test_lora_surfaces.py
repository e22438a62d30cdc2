"""Issue 22 acceptance on tiny:lingbot, through the installed console script: ``omnicore generate tiny:lingbot "x"
--lora ./a_lora --lora ./b_lora:0.5 -o x.mp4``, and the same request through ``omnicore serve --lora-modules`` over
HTTP (``/v1/videos``), both with adapters peft itself wrote on the tiny preset's DiT. The two MP4s decode to the
same frames (same engine, same writer), differ from the run without adapters, and the server lists its adapters.
Tiny models output noise: only equalities are checked.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("omni_lingbot", reason="omni-plugin-lingbot is not installed")
av = pytest.importorskip("av")
pytest.importorskip("peft", reason="the adapters are written by peft")

pytestmark = pytest.mark.slow

_SCRIPT = shutil.which("omnicore", path=str(Path(sys.executable).parent)) or shutil.which("omnicore")
ARGS = ["--height", "32", "--width", "32", "--num-frames", "5", "--steps", "2", "--seed", "3"]
ATTN = [f"blocks.{i}.attn.to_{p}" for i in range(2) for p in ("q", "v")]
FFN = [f"blocks.{i}.ffn.{p}" for i in range(2) for p in ("up_proj", "down_proj")]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A cache with the tiny preset, and ``a_lora`` / ``b_lora`` made by peft on its DiT, in one directory."""
    from _lora_helpers import make_peft_adapter
    from omnicore.config import Settings
    from omnicore.engine.api import Engine

    root = tmp_path_factory.mktemp("lora-acceptance")
    cache = root / "cache"
    with Engine("tiny:lingbot", settings=Settings(cache_dir=str(cache))) as engine:
        assert engine.spec.lora is not None, "the LingBot plugin declares LoRA targets (ModelSpec.lora)"
        dit = engine.pipeline.transformer
        make_peft_adapter(dit, ATTN, root / "a_lora", rank=4, seed=1, std=0.2)
        make_peft_adapter(dit, ATTN + FFN, root / "b_lora", rank=8, seed=2, std=0.2)
    env = {**os.environ, "OMNICORE_CACHE": str(cache), "OMNICORE_PLUGINS": "lingbot",
           "OMNICORE_SHUTDOWN_GRACE_S": "5", "PYTHONWARNINGS": "ignore"}
    for name in ("OMNICORE_DISABLE_PLUGINS", "OMNICORE_LORA_MODULES", "OMNICORE_LORA_DIRS"):
        env.pop(name, None)
    return {"root": root, "env": env}


def _frames(data: bytes | Path) -> np.ndarray:
    import io

    with av.open(str(data) if isinstance(data, Path) else io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def _generate(work: dict, *args: str) -> subprocess.CompletedProcess[str]:
    assert _SCRIPT is not None, "the `omnicore` console script is not installed next to this interpreter"
    return subprocess.run([_SCRIPT, "generate", "tiny:lingbot", "x", *args, *ARGS, "--no-progress"],
                          cwd=work["root"], env=work["env"], capture_output=True, text=True, timeout=600)


def test_generate_with_two_adapters_and_the_same_request_over_http(work: dict) -> None:
    root = work["root"]
    proc = _generate(work, "--lora", "./a_lora", "--lora", "./b_lora:0.5", "-o", "x.mp4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "5 frames" in proc.stdout
    adapted = _frames(root / "x.mp4")
    plain = _generate(work, "-o", "plain.mp4")
    assert plain.returncode == 0, plain.stderr
    assert not np.array_equal(adapted, _frames(root / "plain.mp4"))  # the adapters change the noise

    serve = subprocess.Popen([_SCRIPT, "serve", "tiny:lingbot", "--port", "0", "--lora-modules", "a=./a_lora",
                              "--lora-modules", "b=./b_lora"], cwd=root, env=work["env"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(ln.rstrip("\n") for ln in serve.stderr), daemon=True)
    reader.start()
    try:
        base = _wait_for(lines, serve, r"serving \S+ \(tiny:lingbot\) at (http://\S+);", 240)
        with httpx.Client(base_url=base, timeout=60) as c:
            card = c.get("/v1/models").json()["data"][0]["omnicore"]
            assert [x["name"] for x in card["loras"]] == ["a", "b"]
            body = {"prompt": "x", "size": "32x32", "num_frames": 5, "num_inference_steps": 2, "seed": 3,
                    "lora": [{"name": "a"}, {"name": "b", "scale": 0.5}]}
            vid = c.post("/v1/videos", json=body).json()["id"]
            for _ in range(1200):
                job = c.get(f"/v1/videos/{vid}").json()
                if job["status"] in ("completed", "failed"):
                    break
                time.sleep(0.1)
            assert job["status"] == "completed", job
            over_http = _frames(c.get(f"/v1/videos/{vid}/content").content)
            refused = c.post("/v1/videos", json={**body, "lora": [{"path": "./a_lora"}]})  # no --lora-dir: names only
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_lora", refused.text
            assert "omnicore_lora_loads_total" in c.get("/metrics").text
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            serve.wait(60)
        finally:
            if serve.poll() is None:
                serve.kill()
    assert np.array_equal(over_http, adapted)  # the CLI and the server ran the same adapted request


def _wait_for(lines: list[str], proc: subprocess.Popen, pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(lines):
            m = re.search(pattern, line)
            if m:
                return m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(lines))
