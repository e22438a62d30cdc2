"""Child process of tests/core/test_plan_memory_per_preset.py (run as a script, one model per process).

``build KIND DIR``: write the mid-size checkpoint of a tiny preset (the preset's own builder with wider DiT
configs, see MID); ``measure KIND DIR``: price it with ``omnicore plan`` (float32, one CPU device, no reserve), warm
the same code paths on the tiny preset (imports, kernels, lazy inits), take the RSS baseline, then load the mid-size
checkpoint into an Engine and run one request, measuring the rise of the process's resident set: after the load
(weights), and the peak of the generation (our own VmHWM window around the request, and the engine's
``peak_memory_bytes`` metric, both less the baseline). Prints one JSON line."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

#: per tiny preset: the DiT widened (what the test calls the mid-size preset), the request, and the tiny warm-up one
MID: dict[str, dict[str, Any]] = {
    "lingbot": {"tiny": "tiny:lingbot", "dit": {"hidden_size": 1024, "num_attention_heads": 8,
                                                "intermediate_size": 4096, "axes_dims": [32, 48, 48]},
                "request": {"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 1,
                            "guidance_scale": 1.0, "extra": {"vae_tiling": True}}},
    "lingbot-moe": {"tiny": "tiny:lingbot-moe", "dit": {"hidden_size": 1024, "num_attention_heads": 8,
                                                        "intermediate_size": 4096, "moe_intermediate_size": 1024,
                                                        "axes_dims": [32, 48, 48]},
                    "request": {"height": 1024, "width": 1024, "num_frames": 1, "num_inference_steps": 1,
                                "guidance_scale": 1.0, "extra": {"vae_tiling": True}}},
    "minimax-h3": {"tiny": "tiny:minimax-h3", "dit": {"hidden_size": 1024, "num_attention_heads": 8,
                                                      "attention_head_dim": 128, "ffn_dim": 4096, "rope_freq_dim": 16,
                                                      "time_embed_hidden_dim": 256},
                   "canvas": 256,
                   "request": {"duration": 4.0, "num_inference_steps": 1, "extra": {"aspect_ratio": "16:9"}}},
    "hunyuan-image3": {"tiny": "tiny:hunyuan-image3",
                       "dit": {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
                               "attention_head_dim": 128, "num_hidden_layers": 2, "intermediate_size": 4096,
                               "moe_intermediate_size": 1024, "num_experts": 4, "moe_topk": 2,
                               "patch_embed_hidden_dim": 64},
                       "base_size": 512, "options": {"vae_tile_size": 256},
                       "request": {"height": 512, "width": 512, "num_inference_steps": 1, "guidance_scale": 1.0}},
}
PROMPT = "a red fox in the snow"


def build(kind: str, root: Path) -> None:
    mid = MID[kind]
    if kind.startswith("lingbot"):
        from omni_lingbot import presets as lp

        base = lp.TINY_MOE if kind == "lingbot-moe" else lp.TINY_DIT
        cfg = {**base, **mid["dit"]}
        lp.build_tiny(root, cfg, refiner_config=cfg if kind == "lingbot-moe" else None)
    elif kind == "minimax-h3":
        from omni_minimax_h3 import presets as hp

        hp.TINY_DIT = {**hp.TINY_DIT, **mid["dit"]}
        hp.TINY_CANVAS_SHORT_EDGE = mid["canvas"]
        hp.TINY_CANVAS_MAX_PIXELS = mid["canvas"] * mid["canvas"] * 2
        hp.build_tiny(root, ("fl2va",))
    else:
        from omni_hunyuan.presets import build_tiny

        build_tiny(root, base_size=mid["base_size"], overrides=mid["dit"])


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure(kind: str, root: Path) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    from omnicore.cli.plan_cmd import build_plan
    from omnicore.engine.api import Engine, make_request
    from omnicore.planning.estimate import CostModel

    mid = MID[kind]
    plan = build_plan(str(root), request={**mid["request"], "prompt": PROMPT}, dtype="float32",
                      cost=CostModel.for_platform("cpu"))
    row = next(p for p in plan.placements if p.name == "single")
    small = {k: v for k, v in mid["request"].items() if k not in ("height", "width", "duration")}
    # the tiny preset first: imports, kernels, allocator pools, everything but the sizes
    with Engine(mid["tiny"], model_options=mid.get("options")) as warm:
        warm.submit(make_request(PROMPT, seed=1, **small)).result(600)
    del warm
    gc.collect()
    base = _status("VmRSS")
    with Engine(str(root), model_options=mid.get("options")) as engine:
        loaded = _status("VmRSS") - base
        pipeline, seen = engine.pipeline, []
        decode = pipeline.decode

        def read_then_decode(state: Any) -> Any:  # the high-water mark as the decode starts: encode + denoise
            seen.append(_status("VmHWM") - base)
            return decode(state)

        pipeline.decode = read_then_decode
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: our own window around the request
        [out] = engine.submit(make_request(PROMPT, seed=1, **mid["request"])).result(1200)
        peak = _status("VmHWM") - base
    return {"kind": kind, "base": base, "weights_rss": loaded, "peak_rise": peak, "denoise_rise": seen[0],
            "metric_rise": int(out.metrics["peak_memory_bytes"]) - base,
            "plan_weights": sum(row.weights.values()), "plan_activations": row.activations,
            "plan_caches": sum(row.caches.values()), "plan_per_rank": row.per_rank, "tokens": plan.request["tokens"],
            "components": {k: v["bytes"] for k, v in plan.components.items()}, "pid": os.getpid()}


if __name__ == "__main__":
    action, kind, folder = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if action == "build":
        build(kind, folder)
    else:
        print(json.dumps(measure(kind, folder)))
