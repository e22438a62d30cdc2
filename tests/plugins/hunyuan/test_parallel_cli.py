"""Issue 20 acceptance (HunyuanImage-3): ``omnicore generate tiny:hunyuan-image3 ... --parallel tp=2`` (and ``ep=2``,
``cfg=2,tp=2``) writes the image of the single-process run with the same seed (the console script, the spawned gloo
ranks, the PNG writer: lossless, so compared pixel for pixel within one uint8 level of fp32 reassociation)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("omni_hunyuan", reason="omni-plugin-hunyuan is not installed")

pytestmark = pytest.mark.slow  # each case starts the console script (and worker processes)

_SCRIPT = shutil.which("omnicore", path=str(Path(sys.executable).parent)) or shutil.which("omnicore")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("omnicore-cache")


def generate(cache: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if _SCRIPT is None:
        pytest.fail("the `omnicore` console script is not installed next to this interpreter")
    env = {**os.environ, "OMNICORE_CACHE": str(cache)}
    command = [_SCRIPT, "generate", "tiny:hunyuan-image3", "a lighthouse at dusk", "--height", "256", "--width",
               "256", "--steps", "2", "--seed", "5", "--no-progress", "-o", str(out), *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def single(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    from PIL import Image

    out = tmp_path_factory.mktemp("single") / "single.png"
    proc = generate(cache, out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return np.asarray(Image.open(out).convert("RGB"))


@pytest.mark.parametrize("parallel", ["tp=2", "ep=2", "cfg=2,tp=2"])
def test_parallel_generate_writes_the_single_process_image(cache: Path, tmp_path: Path, single: np.ndarray,
                                                           parallel: str) -> None:
    from PIL import Image

    out = tmp_path / "split.png"
    proc = generate(cache, out, "--parallel", parallel)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = np.asarray(Image.open(out).convert("RGB"))
    assert got.shape == single.shape == (256, 256, 3)
    assert np.abs(got.astype(int) - single.astype(int)).max() <= 1
