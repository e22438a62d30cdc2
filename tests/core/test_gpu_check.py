"""The prepared GPU check (``benchmarks/gpu_check.sh``, ``make gpu-check``): its dry mode runs the whole plumbing
on this CPU-only machine — steps with time limits, the CUDA tests collected, the GPU benchmark's skip record, the
JSON and markdown report — so the script works the day a GPU is lent. What it measures on a GPU is unverified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def test_unknown_argument_is_refused():
    proc = subprocess.run(["bash", str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "unknown argument --bogus" in proc.stderr


@pytest.mark.slow
def test_dry_run_writes_the_report(tmp_path):
    out = tmp_path / "gpu"
    proc = subprocess.run(["bash", str(SCRIPT), "--dry", "--out", str(out), "--python", sys.executable],
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry"] is True
    assert [s["step"] for s in report["steps"]] == ["tests_backend_cuda", "tests_gpu_marked", "benchmarks"]
    assert all(s["status"] == "ok" for s in report["steps"]), report["steps"]
    assert report["tests"]["tests_backend_cuda"]["collected"] > 0
    skipped = {s["script"]: s for s in report["benchmark_scripts"]}
    assert skipped["gpu_kernels.py"]["status"] == "skipped" and "no CUDA" in skipped["gpu_kernels.py"]["skipped"]
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check (dry run") and "| tests_backend_cuda | ok |" in md
