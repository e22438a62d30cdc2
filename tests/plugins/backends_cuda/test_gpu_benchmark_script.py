"""``benchmarks/gpu_kernels.py``: skips cleanly without CUDA, and its cases are well-formed (each arm run once at
tiny sizes on the CPU in Triton's interpreter, both arms agreeing)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _cuda_helpers import CUDA_REASON

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_kernels.py"


@pytest.mark.skipif(CUDA_REASON is None, reason="checks the behaviour without CUDA")
def test_without_cuda_the_script_says_skipped_and_exits_0():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    record = json.loads(proc.stdout)  # one skip record, which `make bench` lists as skipped (not failed)
    assert proc.returncode == 0 and record["benchmark"] == "gpu_kernels" and record["skipped"].startswith("no CUDA")


@pytest.mark.slow
@pytest.mark.skipif(CUDA_REASON is None, reason="the tiny run is for machines without CUDA (the interpreter)")
def test_every_case_runs_both_arms_and_they_agree():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location("gpu_kernels_script", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        names = []
        for case in module.cases(device="cpu", tiny=True):
            a, b = case.run_a(), case.run_b()
            for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                x = x.transpose(0, 1) if case.arm_b == "sdpa_block_mask" else x  # [T, H, D] vs [1, H, T, D]
                y = y[0] if case.arm_b == "sdpa_block_mask" else y
                torch.testing.assert_close(x.float(), y.float(), atol=7e-2, rtol=3e-2, msg=case.case)
            names.append(case.case)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    assert sum(n.startswith("attn_") for n in names) == 2 and len(names) == 9, names
    assert any(n.startswith("lora_segment_delta_") for n in names), names
