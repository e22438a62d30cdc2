"""LingBot DiT forward metadata reused across denoise steps vs rebuilt at every forward.

Each arm is one whole ``LingBotPipeline.predict()`` of a denoise step (all CFG forwards and the guidance mix) on a
state from the real ``encode()``. Arm A reuses the per-branch ``ForwardMetadata`` (packed layout, ``cu_seqlens``,
RoPE positions and frequencies, real-text index) built at the branch's first call; arm B
(``reuse_forward_metadata = False``) rebuilds it inside every forward, which is what the DiT did before. Both
pipelines share one set of modules, so the work differs only by the metadata; ``max_abs_diff`` (goal 0) proves
the predictions are bit-identical.

Cases: a mid-size DiT (hidden 256, 4 heads of 64, depth 4, 3200 video tokens at 320x512x17) with sequential and
batch CFG, where the model's arithmetic dwarfs the metadata on a CPU; and the tiny presets (8 video tokens,
dense and MoE), where the metadata is a visible share of a step. Each record also carries ``metadata_build_s``
(median time to build one step's records, measured apart): over ``b_median_s`` it is the saving the ratio should
show. At the mid size that saving (~0.3 ms of ~0.8 s, 0.04 %) is far below the run-to-run noise of a shared 2-core
host: an A/A run (both arms the same reusing pipeline) measured ratio 1.03 there, so the mid-size goal is met or
missed by noise; the tiny cases show the saving clearly. On CUDA the rebuild also costs host syncs (mask sums, the RoPE table bound, the
boolean text gather) that stall the launch queue; this CPU benchmark cannot show that part.

Goal: wall ``ratio <= 1.0`` (the brief's goal, on wall time as users feel it; ``cpu_ratio`` is reported beside it
and is the steadier number on a busy 2-core host) and ``max_abs_diff <= 0``.
Run: ``python benchmarks/lingbot_step_metadata.py [--reps N] [--case tiny] [--threads 2]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Case, Goal, main, ratio_at_most

MID_DIT: dict[str, Any] = {
    "patch_size": [1, 2, 2], "in_channels": 4, "out_channels": 4, "hidden_size": 256, "num_attention_heads": 4,
    "depth": 4, "intermediate_size": 768, "text_dim": 32, "freq_dim": 256, "axes_dims": [16, 24, 24],
    "axes_lens": [1024, 256, 256],
}
PROMPT = "a red fox runs through deep snow at dawn, its breath steaming in the cold air"
NEGATIVE = "blurry, low quality"


def _load(root: Path) -> Any:
    from omni_lingbot.pipeline import LingBotPipeline
    from omnicore.engine.protocol import LoadOptions
    from omnicore.platforms.cpu import CpuPlatform

    return LingBotPipeline.from_pretrained(root, LoadOptions(platform=CpuPlatform()))


def _twin(pipe: Any) -> Any:
    """A second pipeline over the same modules that rebuilds the metadata at every forward."""
    other = type(pipe)(pipe.transformer, pipe.text_encoder, pipe.vae, pipe.scheduler_config, device=pipe.device,
                       dtype=pipe.dtype, path=pipe.path, refiner=pipe.refiner)
    other.reuse_forward_metadata = False
    return other


def _state(pipe: Any, batch_cfg: bool, **params: Any) -> Any:
    from omnicore.engine.request import GenerationRequest, SamplingParams

    req = GenerationRequest(PROMPT, SamplingParams(guidance_scale=3.0, num_inference_steps=8, seed=5, **params),
                            modalities=("video",), negative_prompt=NEGATIVE, extra={"batch_cfg": batch_cfg})
    return pipe.encode([pipe.preprocess(req)])


def _branch_inputs(pipe: Any, state: Any) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The (latents, text, mask) of each DiT call of one predict(), as the pipeline hands them to the DiT."""
    ex, lat = state.extras, state.latents.to(pipe.dtype)
    if ex["batch_cfg"]:
        calls = [(torch.cat([lat, lat]), *ex["pair"])]
    else:
        calls = [(lat, *ex["cond"]), (lat, *ex["uncond"])]
    return [(x, e.to(pipe.device, pipe.dtype), m.to(pipe.device)) for x, e, m in calls]


def _build_time(pipe: Any, state: Any, reps: int = 21) -> float:
    """Median seconds to build one step's metadata records (what arm B pays on top of arm A per step)."""
    calls = _branch_inputs(pipe, state)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for x, e, m in calls:
            pipe.transformer.forward_metadata(x, e, m)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _case(name: str, pipe: Any, batch_cfg: bool, reps: int, **params: Any) -> Case:
    reuse, rebuild = pipe, _twin(pipe)
    state_a, state_b = _state(reuse, batch_cfg, **params), _state(rebuild, batch_cfg, **params)
    step = 1  # any step: predict() reads the state and does not change it for T2V
    grid = [n // p for n, p in zip(state_a.latents.shape[2:], pipe.transformer.config.patch_size)]
    calls = _branch_inputs(pipe, state_a)
    build_s = _build_time(pipe, state_a)

    def run_a() -> torch.Tensor:
        with torch.no_grad():
            return reuse.predict(state_a, step)

    def run_b() -> torch.Tensor:
        with torch.no_grad():
            return rebuild.predict(state_b, step)

    def compare(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
        return {"max_abs_diff": float((a - b).abs().max()), "identical": bool(torch.equal(a, b))}

    def extra() -> dict[str, Any]:
        records = state_a.extras["forward_metadata"]
        return {
            "hidden_size": pipe.transformer.config.hidden_size,
            "depth": pipe.transformer.config.depth,
            "video_tokens": grid[0] * grid[1] * grid[2],
            "dit_calls_per_step": len(calls),
            "packed_rows_per_call": [md.layout.total for md in records.values()],
            "metadata_records": sorted(records),
            "metadata_bytes": sum(md.nbytes for md in records.values()),
            "metadata_build_s": build_s,
            "threads": torch.get_num_threads(),
        }

    return Case("lingbot_step_metadata", name, "reused_metadata", "rebuilt_every_forward", run_a, run_b,
                goal=(ratio_at_most(1.0), Goal("<=", 0.0, "max_abs_diff")), reps=reps, warmup=2, compare=compare,
                extra=extra)


def cases(args: argparse.Namespace) -> Any:
    from omni_lingbot.presets import build_tiny, build_tiny_lingbot, build_tiny_lingbot_moe

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="lingbot-step-metadata-") as tmp:
        root = Path(tmp)
        mid = _load(build_tiny(root / "mid", MID_DIT))
        size = {"height": 320, "width": 512, "num_frames": 17}  # latent 5x40x64 -> 5x20x32 = 3200 video tokens
        yield _case("mid_h256_d4_3200tok_sequential_cfg", mid, False, args.mid_reps, **size)
        yield _case("mid_h256_d4_3200tok_batch_cfg", mid, True, args.mid_reps, **size)
        tiny = _load(build_tiny_lingbot(root / "tiny"))
        small = {"height": 32, "width": 32, "num_frames": 5}  # the test preset's request: 8 video tokens
        yield _case("tiny_preset_sequential_cfg", tiny, False, args.tiny_reps, **small)
        yield _case("tiny_preset_batch_cfg", tiny, True, args.tiny_reps, **small)
        moe = _load(build_tiny_lingbot_moe(root / "moe"))
        yield _case("tiny_moe_preset_batch_cfg", moe, True, args.tiny_reps, **small)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--mid-reps", type=int, default=9)
    parser.add_argument("--tiny-reps", type=int, default=101)
    known, rest = parser.parse_known_args()
    raise SystemExit(main(lambda: cases(known), rest))
