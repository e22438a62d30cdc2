"""MiniMax-H3 end to end: ``tiny:minimax-h3`` t2va through our engine vs diffusers' ``MiniMaxH3ModularPipeline``
on the same components (the preset's weights: DiT, 51-layer Qwen3-VL, video and audio VAEs), same request and seed.

Arm A is ``Engine.generate`` (preprocess, Qwen3-VL presentation, noise, packed plan, denoise, both VAE decodes;
uint8 frames + float waveform); arm B is the modular pipeline's ``__call__`` (``output_type="np"``, videos and
audio). diffusers generates at least 5 s, so every case is a 124-frame (5.17 s) 16:9 clip on the tiny 64x128 canvas.
diffusers' ``num_inference_steps`` counts grid points and ours model calls: B gets ``steps + 1``. Each record
carries ``max_frame_diff`` (uint8 levels) and ``max_audio_diff`` between the arms' outputs.

Cases: ``t2va_5s_49steps`` — the release's default grid (50 points, 49 DiT calls): goal ratio <= 0.7;
``t2va_5s_8steps`` — a short (distilled-style) schedule, where the shared VAE decodes are a large share of a run:
reported with goal ratio <= 1.0.

What differs between the arms (everything else is the same diffusers VAEs): the text encoder runs 50 layers and
reads layer 50 with a hook (diffusers: 51 layers, the final norm and all 52 hidden states kept); our DiT refines
the text and builds the RoPE table once per request instead of every step, gathers AdaLN rows once per block,
runs fused qkv, packs attention without a mask and applies the output heads to video/audio rows only; every
step's distinct timesteps are computed once on the host (no ``inspect`` / ``torch.unique`` per step).

Threads: ``--threads`` (default 1) intra-op threads for both arms, set through ``OMP_NUM_THREADS`` before torch loads
(the engine works on its own threads, which a ``torch.set_num_threads`` call would not reach): on a shared 2-core
host two intra-op threads make every tiny op wait on the other one (a 60 ms forward took 1.8 s at load 10),
which would measure the host, not the code. Ours decodes the soundtrack on a helper thread beside the frames.
Run: ``python benchmarks/minimax_h3_e2e.py [--reps 5] [--case 49steps] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plugins" / "minimax_h3"))
from _harness import Case, main, ratio_at_most

PROMPT = "rain on a tin roof at night, a dog barks in the distance"
FRAMES = 124
SEED = 3


def cases(threads: int) -> Any:
    import numpy as np
    import torch
    from _h3_peer import peer_pipeline
    from omni_minimax_h3.presets import build_tiny_fl2va
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.plugin_host.host import PluginHost

    torch.set_num_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix="h3-e2e-"))
    repo = build_tiny_fl2va(tmp / "repo")
    settings = Settings(cache_dir=str(tmp / "cache"), plugins=("minimax_h3",))
    engine = Engine(str(repo), host=PluginHost(settings), settings=settings)
    peer = peer_pipeline(repo)
    peer.set_progress_bar_config(disable=True)

    for steps, goal in ((49, 0.7), (8, 1.0)):
        def ours(steps: int = steps) -> Any:
            out = engine.generate(PROMPT, num_frames=FRAMES, num_inference_steps=steps, seed=SEED,
                                  extra={"aspect_ratio": "16:9"})[0]
            return out.frames, out.audio

        def diffusers(steps: int = steps) -> Any:
            out = peer(prompt=PROMPT, num_frames=FRAMES, num_inference_steps=steps + 1, height=64, width=128,
                       generator=torch.Generator().manual_seed(SEED), output_type="np", output=["videos", "audio"])
            return (out["videos"][0] * 255.0).round().astype(np.uint8), out["audio"][0].numpy()

        def compare(a: Any, b: Any) -> dict[str, Any]:
            return {"max_frame_diff": int(np.abs(a[0].astype(int) - b[0].astype(int)).max()),
                    "max_audio_diff": float(np.abs(a[1] - b[1]).max()), "frames": int(a[0].shape[0]),
                    "audio_samples": int(a[1].shape[1])}

        yield Case("minimax_h3_e2e", f"t2va_5s_{steps}steps", "omnicore_engine", "diffusers_modular", ours, diffusers,
                   goal=ratio_at_most(goal), reps=5, warmup=1, compare=compare,
                   extra={"threads": threads, "canvas": "64x128", "dit": "tiny (hidden 64, 2 blocks)"})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--threads", type=int, default=1)
    known, rest = parser.parse_known_args()
    # before torch loads: the engine denoises and decodes on worker threads, which do not inherit a
    # torch.set_num_threads() made on this one
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(known.threads)
    raise SystemExit(main(lambda: cases(known.threads), rest))
