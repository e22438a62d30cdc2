"""``omnicore generate tiny:hunyuan-image3 ...`` end to end through the installed console script: text to image
and the ``--image`` edit form (issue acceptance)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytestmark = pytest.mark.slow

_SCRIPT = shutil.which("omnicore", path=str(Path(sys.executable).parent)) or shutil.which("omnicore")


def generate(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if _SCRIPT is None:
        pytest.fail("the `omnicore` console script is not installed next to this interpreter")
    env = {**os.environ, "OMNICORE_CACHE": str(cache), "OMNICORE_PLUGINS": "hunyuan"}
    env.pop("OMNICORE_DISABLE_PLUGINS", None)
    proc = subprocess.run([_SCRIPT, "generate", "tiny:hunyuan-image3", *args, "--no-progress"], capture_output=True,
                          text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_generate_then_edit(tmp_path):
    cache = tmp_path / "cache"
    out = tmp_path / "out.png"
    generate(cache, "a lighthouse at dusk", "--height", "256", "--width", "256", "--steps", "2", "--seed", "1",
             "-o", str(out))
    with Image.open(out) as im:
        assert im.size == (256, 256) and im.mode == "RGB"
        first = np.asarray(im)
    edit = tmp_path / "edit.png"
    generate(cache, "make it blue", "--image", str(out), "--steps", "2", "--seed", "1",
             "--model-option", "kv_mode=paged_scheduler", "-o", str(edit))
    with Image.open(edit) as im:
        assert im.size == (256, 256)
        assert not np.array_equal(np.asarray(im), first)


def test_think_recaption_writes_the_image_and_the_text_beside_it(tmp_path):
    out = tmp_path / "fox.png"
    proc = generate(tmp_path / "cache", "a fox", "--extra", 'bot_task="think_recaption"', "--extra",
                    "max_new_tokens=8", "--steps", "1", "--seed", "2", "-o", str(out))
    text = (tmp_path / "fox.png.txt").read_text(encoding="utf-8").strip()
    assert out.is_file() and text  # random weights: the text is noise, but it is the model's and it is kept
    assert f"wrote {tmp_path / 'fox.png.txt'} (the model's text)" in proc.stdout and text in proc.stdout
