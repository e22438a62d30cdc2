"""HunyuanImage-3 paged prefix-KV pool: time to the first denoise step of a request whose prompt is in the pool
(hit) vs one that is not (miss) — the same prompt with a new seed each time (docs/contracts-status.md C5).

Each arm is ``preprocess`` (tokenise, prepared layout, block hashes) + ``encode`` + ``predict`` of step 0 in the
``paged_scheduler`` KV mode. Arm A finds every full prefix block of both CFG rows in the pool (published by the
previous run) and computes only the rest of the prefix and the target; arm B clears the pool first and computes
the whole sequence. ``hit_tokens`` / ``miss_tokens`` show what each found. Model: the benchmark's mid-size one
(hidden 256, 4 MoE layers), a ~600-token prompt and a 256x256 image (256 image tokens).

Goal: wall ``ratio <= 0.5``. Run: ``python benchmarks/hunyuan_prefix_pool.py [--reps N] [--threads 1]``.
One intra-op thread by default (as ``minimax_h3_dit``/``minimax_h3_e2e``): on a shared, overloaded 2-core host,
2 threads made OpenMP spin-waiting under contention dominate the many small ops of these models — on
2026-12-01 the same code measured hit 0.35 s / miss 1.23 s (ratio 0.28) at 1 thread and 5.9 s / 5.8 s (1.02) at
2 threads, back to back — so the 2-thread number measures the host, not the pool. ``--threads 2`` still runs it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Case, main, ratio_at_most
from hunyuan_kv_reuse import MID, PROMPT, load


def first_step(pipe: Any, seed: int) -> tuple[torch.Tensor, int]:
    from omnicore.engine.request import GenerationRequest, SamplingParams

    req = GenerationRequest(PROMPT, SamplingParams(height=256, width=256, num_inference_steps=8, seed=seed,
                                                   guidance_scale=4.0))
    state = pipe.encode([pipe.preprocess(req)])
    pred = pipe.predict(state, 0)
    return pred, state.extras["items"][0]["pool_hit_tokens"]


def cases(args: argparse.Namespace) -> Any:
    from omni_hunyuan.presets import build_tiny

    torch.set_num_threads(args.threads)
    with torch.no_grad(), tempfile.TemporaryDirectory(prefix="hunyuan-pool-") as tmp:
        pipe = load(build_tiny(Path(tmp) / "mid", overrides=MID), kv_mode="paged_scheduler", kv_block_size=16,
                    kv_pool_blocks=4096)
        seeds = itertools.count(100)
        first_step(pipe, next(seeds))  # publish the prompt's blocks
        seen: dict[str, int] = {}

        def run_hit() -> Any:
            pred, hit = first_step(pipe, next(seeds))
            seen["hit_tokens"] = hit
            return pred

        def run_miss() -> Any:
            pipe.pool.clear()
            pred, hit = first_step(pipe, next(seeds))
            seen["miss_tokens"] = hit
            return pred

        def extra() -> dict[str, Any]:
            stats = pipe.kv_pool_stats()
            return {**seen, "pool": stats, "prompt_tokens": 606, "image_tokens": 256, "block_size": 16,
                    "threads": torch.get_num_threads()}

        yield Case("hunyuan_prefix_pool", "mid_h256_l4_prompt606_img256_cfg", "pool_hit", "pool_miss", run_hit,
                   run_miss, goal=ratio_at_most(0.5), reps=args.reps_default, warmup=1, extra=extra)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps-default", type=int, default=7)
    known, rest = parser.parse_known_args()
    raise SystemExit(main(lambda: cases(known), rest))
