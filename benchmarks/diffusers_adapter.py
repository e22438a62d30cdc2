"""The generic diffusers adapter (``omni-plugin-diffusers``) vs calling the same diffusers pipeline directly.

Both arms load one checkpoint (a random-weight FluxPipeline written by ``save_pretrained``, the adapter's
``tiny:diffusers-flux`` layout) and are timed interleaved by the harness:

- ``overhead_1req``: arm "omnicore" = ``engine.generate`` of one request (queue, preprocess, the stepped call on
  its worker thread parked at every step, outputs); arm "diffusers" = ``pipe(prompt, generator=...)`` with the
  same arguments. ``ratio`` = omnicore / diffusers at equal work (goal <= 1.05). The outputs must be equal.
- ``batched_8req``: arm "omnicore" = 8 requests submitted at once to an engine with ``max_num_seqs=8`` and a
  20 ms admission wait (they run as one diffusers call with 8 prompts and 8 generators); arm "diffusers" = the
  same 8 requests as 8 calls of the pipeline in a loop. ``throughput_gain`` = loop time / omnicore time
  (goal >= 1.5, i.e. ``ratio <= 0.667``); ``max_pixel_diff`` compares every batched row with its solo call.

Both arms use ``--threads`` intra-op threads (default 1): on a loaded 2-core machine, torch's OpenMP team in the
calling thread is at the mercy of other processes (measured here: the same call 0.08 s on one thread, 0.8-2.8 s
on a 2-thread team from the main thread), which would make the comparison measure the machine, not the adapter.

- ``ceiling_stock_batched_8req``: diffusers' own batched call (8 prompts, 8 generators) vs the loop, no omnicore
  in either arm: what batching this pipeline can gain at all on this machine (the adapter's batch is that call).

All three run at each of ``--sizes`` (default 32 and 64 pixels: 256 and 1024 transformer tokens per image; a
real FLUX makes 256 tokens at 256x256 and 1024 at 512x512). Few tokens per row is where one batched call
amortises the per-call work (text encoding, scheduler set-up, VAE, Python); at 1024 tokens a CPU is compute-bound
and the batch costs about what the loop costs.

Run: ``python benchmarks/diffusers_adapter.py [--reps 7] [--sizes 32,64] [--steps 4] [--threads 1]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Case, main, ratio_at_most, skipped  # noqa: E402

N_REQUESTS = 8


def _engine(ckpt: Path, cache: Path, *, max_num_seqs: int, wait_ms: float) -> Any:
    from omnicore.config import Settings
    from omnicore.engine.api import Engine
    from omnicore.testing import add_loaded, isolated_host

    settings = Settings(cache_dir=str(cache), max_num_seqs=max_num_seqs, request_batch_max_wait_ms=wait_ms)
    host = isolated_host(settings)
    add_loaded(host, "omni_diffusers.plugin")
    return Engine(str(ckpt), host=host, settings=settings)


def cases(args: argparse.Namespace, tmp: Path) -> Any:
    try:
        import diffusers
        import torch
        from omni_diffusers.presets import build_flux
    except ImportError as exc:
        yield skipped("diffusers_adapter", f"omni-plugin-diffusers or diffusers is not installed: {exc}")
        return
    torch.set_num_threads(args.threads)
    ckpt = tmp / "tiny-flux"
    build_flux(ckpt)
    pipe = diffusers.DiffusionPipeline.from_pretrained(str(ckpt))
    pipe.set_progress_bar_config(disable=True)
    steps = args.steps
    prompts = [f"a small scene number {i} with a red fox" for i in range(N_REQUESTS)]

    def direct(prompt: str, seed: int, size: int) -> np.ndarray:
        images = pipe(prompt, generator=torch.Generator().manual_seed(seed), height=size, width=size,
                      num_inference_steps=steps, guidance_scale=3.5, max_sequence_length=32).images
        return np.asarray(images[0])

    def direct_batch(size: int) -> list[np.ndarray]:
        images = pipe(prompts, generator=[torch.Generator().manual_seed(i) for i in range(N_REQUESTS)], height=size,
                      width=size, num_inference_steps=steps, guidance_scale=3.5, max_sequence_length=32).images
        return [np.asarray(i) for i in images]

    solo = _engine(ckpt, tmp / "cache", max_num_seqs=1, wait_ms=0.0)
    batched = _engine(ckpt, tmp / "cache", max_num_seqs=N_REQUESTS, wait_ms=20.0)
    try:
        for size in args.sizes:
            yield from _size_cases(args, size, steps, prompts, direct, solo, batched)
            yield _ceiling(args, size, steps, prompts, direct, direct_batch)
    finally:
        solo.close()
        batched.close()


def _size_cases(args: argparse.Namespace, size: int, steps: int, prompts: list[str], direct: Any, solo: Any,
                batched: Any) -> Any:
    """The two cases at one image size; ``tokens_per_image`` is the transformer's sequence per row (FLUX packs
    2x2 latent patches; the tiny VAE does not downsample), the quantity that decides whether a batch amortises
    per-call work (few tokens) or is compute-bound like the loop (many)."""
    tokens = (size // 2) ** 2
    sizes: dict[str, int] = {}

    def ours_one() -> np.ndarray:
        [out] = solo.generate(prompts[0], seed=1, height=size, width=size, num_inference_steps=steps)
        return out.frames[0]

    def same(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
        return {"max_pixel_diff": int(np.abs(a.astype(int) - b.astype(int)).max())}

    record = Case("diffusers_adapter", f"overhead_1req_flux_{size}px_{steps}steps", "omnicore", "diffusers",
                  ours_one, lambda: direct(prompts[0], 1, size), goal=ratio_at_most(1.05), reps=args.reps or 9,
                  warmup=2, compare=same, extra={"tokens_per_image": tokens}).run()
    record["threads"] = args.threads
    record["met"] = record["met"] and record["max_pixel_diff"] == 0
    record["goal"] += " and bit-identical outputs"
    yield record

    def ours_batch() -> list[np.ndarray]:
        from omnicore.engine.api import make_request

        jobs = [batched.submit(make_request(p, seed=i, height=size, width=size, num_inference_steps=steps))
                for i, p in enumerate(prompts)]
        outs = [j.result(600)[0] for j in jobs]
        sizes["omnicore"] = max(o.metrics["batch_requests"] for o in outs)
        return [o.frames[0] for o in outs]

    def loop() -> list[np.ndarray]:
        return [direct(p, i, size) for i, p in enumerate(prompts)]

    def rows(a: list[np.ndarray], b: list[np.ndarray]) -> dict[str, Any]:
        diff = max(int(np.abs(x.astype(int) - y.astype(int)).max()) for x, y in zip(a, b, strict=True))
        return {"max_pixel_diff": diff, "omnicore_batch_size": sizes.get("omnicore")}

    record = Case("diffusers_adapter", f"batched_8req_flux_{size}px_{steps}steps", "omnicore", "diffusers_loop",
                  ours_batch, loop, goal=ratio_at_most(0.667), reps=args.reps or 5, warmup=1, compare=rows,
                  extra={"omnicore": "max_num_seqs=8, request_batch_max_wait_ms=20",
                         "diffusers_loop": "8 pipeline calls one after another", "tokens_per_image": tokens}).run()
    record["throughput_gain"] = record["b_median_s"] / record["a_median_s"]
    record["threads"] = args.threads
    record["met"] = (record["met"] and record["max_pixel_diff"] <= 1
                     and record["omnicore_batch_size"] == N_REQUESTS)
    record["goal"] += " (throughput >= 1.5x), max_pixel_diff <= 1 and one batch of 8"
    yield record


def _ceiling(args: argparse.Namespace, size: int, steps: int, prompts: list[str], direct: Any,
             direct_batch: Any) -> dict[str, Any]:
    """diffusers' own batched call (8 prompts, 8 generators) vs the same loop: the most any batching of this
    pipeline can gain on this machine, with no omnicore in either arm. Where it stays under 1.5x the goal is out
    of reach for the adapter too (its batch is this very call)."""
    def loop() -> list[np.ndarray]:
        return [direct(p, i, size) for i, p in enumerate(prompts)]

    def rows(a: list[np.ndarray], b: list[np.ndarray]) -> dict[str, Any]:
        return {"max_pixel_diff": max(int(np.abs(x.astype(int) - y.astype(int)).max()) for x, y in zip(a, b,
                                                                                                       strict=True))}

    record = Case("diffusers_adapter", f"ceiling_stock_batched_8req_flux_{size}px_{steps}steps", "diffusers_batched",
                  "diffusers_loop", lambda: direct_batch(size), loop, goal=ratio_at_most(0.667), reps=args.reps or 5,
                  warmup=1, compare=rows, extra={"tokens_per_image": (size // 2) ** 2,
                                                 "diffusers_batched": "one pipeline call with 8 prompts"}).run()
    record["throughput_gain"] = record["b_median_s"] / record["a_median_s"]
    record["threads"] = args.threads
    return record


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[32, 64],
                        help="image sizes, comma-separated (32: 256 tokens per image, 64: 1024)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    known, rest = parser.parse_known_args()
    known.reps = None
    if "--reps" in rest:
        known.reps = int(rest[rest.index("--reps") + 1])
    with tempfile.TemporaryDirectory() as tmp_dir:
        raise SystemExit(main(lambda: cases(known, Path(tmp_dir)), rest))
