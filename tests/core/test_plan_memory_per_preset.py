"""Memory truth per preset (issue 21, item 4): the plan's weights + activation estimate of one CPU device against
the measured peak RSS rise of a real generation and against the engine's ``peak_memory_bytes`` metric.

The tiny presets themselves hold 1-8 MiB of weights and kilobytes of activations, below torch's own fixed costs
(the ~460 MiB baseline, allocator pools, thread scratch), so no ratio of theirs means anything. Each preset is
therefore measured at a **mid size**: the preset's own builder with a wider DiT (hidden 1024, 8 heads of 128; see
``_memory_truth_child.MID``) and a request of about 1,100-4,100 DiT rows, and ``omnicore plan`` prices that same
checkpoint directory and request (float32, one CPU device, no reserve). The child process warms every code path on
the tiny preset first, then takes its RSS baseline, so imports and first-use allocations are not counted.

Measured: the high-water mark when the decode starts (encode + the denoise step, what the plan's estimate is
about), the whole generation's peak (our own ``VmHWM`` window) and the engine's metric; every ratio is printed.
Asserted (runs on the shared 2-core host vary by up to ~10 % between runs):

* LingBot (``vae_tiling``) and LingBot MoE: denoise phase and whole generation within 15 % (measured 0.87-0.95x
  and 1.01-1.05x);
* MiniMax-H3: the denoise phase within 15 % (1.01-1.09x); its tiled VAE decode sets the peak (whole generation
  1.13-1.28x, reported, not asserted): the plan does not estimate VAE activations (docs/plan-json.md);
* HunyuanImage-3: the estimate overprices its activations (denoise phase 0.77-0.90x: the formula's constants are
  calibrated on LingBot), so the band is 0.70-1.15 here, and its VAE decode is the generation's peak (1.57-1.71x,
  asserted above the denoise phase, reported);
* the engine's ``peak_memory_bytes`` equals our own window within 5 % for every preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("_memory_truth_child.py")
#: presets whose VAE decode stays below the denoise step at the measured size (the whole generation is priced)
DECODE_BELOW_DENOISE = ("lingbot", "lingbot-moe")
#: the denoise-phase band per preset (see the module docstring for HunyuanImage-3's)
DENOISE_BAND = {"lingbot": (0.85, 1.15), "lingbot-moe": (0.85, 1.15), "minimax-h3": (0.85, 1.15),
                "hunyuan-image3": (0.70, 1.15)}


def _child(action: str, kind: str, folder: Path, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, str(CHILD), action, kind, str(folder)], env=env, capture_output=True,
                          text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # builds a ~200-360 MB checkpoint and runs it: 40-90 s per preset on the shared 2-core host
@pytest.mark.parametrize("kind", ["lingbot", "lingbot-moe", "minimax-h3", "hunyuan-image3"])
def test_plan_estimate_against_measured_peak(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc (VmHWM reset)")
    env = {**os.environ, "OMNICORE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    _child("build", kind, tmp_path / kind, env)
    m = json.loads(_child("measure", kind, tmp_path / kind, env).strip().splitlines()[-1])
    estimate = m["plan_weights"] + m["plan_activations"] + m["plan_caches"]
    ratios = {key: m[key] / estimate for key in ("denoise_rise", "peak_rise", "metric_rise")}
    mib = 2 ** 20
    with capsys.disabled():
        print(f"\n{kind}: {m['tokens']} rows; plan weights {m['plan_weights'] / mib:.0f} + activations "
              f"{m['plan_activations'] / mib:.0f} + caches {m['plan_caches'] / mib:.0f} = {estimate / mib:.0f} MiB; "
              f"measured rise: denoise {m['denoise_rise'] / mib:.0f} MiB ({ratios['denoise_rise']:.3f}x), "
              f"generation {m['peak_rise'] / mib:.0f} MiB ({ratios['peak_rise']:.3f}x), engine metric "
              f"{m['metric_rise'] / mib:.0f} MiB ({ratios['metric_rise']:.3f}x)")
    low, high = DENOISE_BAND[kind]
    assert low <= ratios["denoise_rise"] <= high, ratios
    assert m["metric_rise"] == pytest.approx(m["peak_rise"], rel=0.05)
    if kind in DECODE_BELOW_DENOISE:
        assert 0.85 <= ratios["peak_rise"] <= 1.15, ratios
        assert 0.85 <= ratios["metric_rise"] <= 1.15, ratios
    elif kind == "hunyuan-image3":  # the decode sets the peak: outside the plan's estimate by construction
        assert m["peak_rise"] > 1.15 * m["denoise_rise"], ratios
