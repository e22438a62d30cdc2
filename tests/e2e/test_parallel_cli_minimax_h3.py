"""Issue 20 acceptance (MiniMax-H3): ``omnicore generate tiny:minimax-h3 ... --parallel ulysses=2`` writes the same
MP4 frames and audio track as the single-process run with the same seed (the console script, two spawned gloo
ranks, the MP4 writer); ``--parallel cfg=2`` fails naming the reason before anything loads."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("omni_minimax_h3", reason="omni-plugin-minimax-h3 is not installed")
av = pytest.importorskip("av")

pytestmark = pytest.mark.slow  # each case starts the console script (and worker processes)

_SCRIPT = shutil.which("omnicore", path=str(Path(sys.executable).parent)) or shutil.which("omnicore")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("omnicore-cache")


def generate(cache: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    if _SCRIPT is None:
        pytest.fail("the `omnicore` console script is not installed next to this interpreter")
    env = {**os.environ, "OMNICORE_CACHE": str(cache)}
    command = [_SCRIPT, "generate", "tiny:minimax-h3", "rain on a tin roof", "--height", "64", "--width", "64",
               "--duration", "4", "--steps", "2", "--seed", "5", "--extra", 'aspect_ratio="1:1"', "--no-progress",
               "-o", str(out), *args]
    return subprocess.run(command, check=False, capture_output=True, text=True, env=env, timeout=600)


def media(path: Path) -> tuple[np.ndarray, np.ndarray]:
    with av.open(str(path)) as container:
        video = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    with av.open(str(path)) as container:
        audio = np.concatenate([f.to_ndarray() for f in container.decode(audio=0)], axis=-1)
    return video, audio


def test_cfg_parallel_fails_with_the_reason(cache: Path, tmp_path: Path) -> None:
    proc = generate(cache, tmp_path / "x.mp4", "--parallel", "cfg=2")
    assert proc.returncode != 0
    assert "parallel" in proc.stderr and "guidance-distilled" in proc.stderr
    assert not (tmp_path / "x.mp4").exists()


def test_ulysses_generate_writes_the_single_process_frames_and_audio(cache: Path, tmp_path: Path) -> None:
    single, split = tmp_path / "single.mp4", tmp_path / "split.mp4"
    for out, extra in ((single, ()), (split, ("--parallel", "ulysses=2"))):
        proc = generate(cache, out, *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    (va, aa), (vb, ab) = media(single), media(split)
    assert va.shape == vb.shape and va.shape[0] >= 96
    assert np.abs(va.astype(int) - vb.astype(int)).max() <= 1  # a uint8 level of fp32 rounding at most
    assert aa.shape == ab.shape and aa.size > 0
    # the encoded (lossy) audio of equal waveforms is equal; fp32 reassociation moves it by rounding only
    assert np.abs(aa.astype(np.float64) - ab.astype(np.float64)).max() <= 1e-3
