"""Engine batching: 8 concurrent small requests on the test-only toy model, batched vs one by one.

Arm "batched": ``max_num_seqs=8`` with a 20 ms admission wait, so the 8 requests form one batch.
Arm "one_by_one": ``max_num_seqs=1`` (no batching; each request runs alone, FIFO).
Both arms live side by side (two engines on the same checkpoint) and are timed interleaved by the harness;
one call submits the same 8 requests (same seeds) at once and waits for the last. ``ratio`` = batched /
one-by-one time; the throughput gain is its inverse (goal >= 1.5, i.e. ``ratio <= 0.667``). The outputs of
both arms are compared (batching may change a pixel by rounding, never more).

The toy's step cost is a stack of ``work x work`` matmuls on one conditioning vector per sample (weight-
bandwidth bound at small batch, like a DiT at batch 1 on an accelerator) plus a small conv on the latents.
Run: ``python benchmarks/batching.py [--reps 7] [--work 1024] [--layers 8] [--steps 8]``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test-only toy model plugin lives in tests/toy
sys.path.insert(0, str(ROOT / "benchmarks"))

from _harness import Case, main, ratio_at_most  # noqa: E402
from omnicore.config import Settings  # noqa: E402
from omnicore.engine.api import Engine  # noqa: E402
from omnicore.engine.request import GenerationRequest, SamplingParams  # noqa: E402
from toy import ToyConfig, build_toy_checkpoint, toy_host  # noqa: E402

N_REQUESTS = 8


def _engine(ckpt: Path, cache: Path, *, max_num_seqs: int, wait_ms: float) -> Engine:
    settings = Settings(cache_dir=str(cache), max_num_seqs=max_num_seqs, request_batch_max_wait_ms=wait_ms)
    return Engine(str(ckpt), host=toy_host(settings), settings=settings)


def cases(args: argparse.Namespace, tmp: Path):
    ckpt = build_toy_checkpoint(tmp / "toy", ToyConfig(work=args.work, work_layers=args.layers))
    batched = _engine(ckpt, tmp / "cache", max_num_seqs=N_REQUESTS, wait_ms=20.0)
    single = _engine(ckpt, tmp / "cache", max_num_seqs=1, wait_ms=0.0)
    requests = [GenerationRequest(f"a small scene number {i}",
                                  SamplingParams(seed=i, num_inference_steps=args.steps, height=32, width=32))
                for i in range(N_REQUESTS)]
    batch_sizes: dict[str, int] = {}

    def arm(engine: Engine, name: str):
        def run():
            jobs = [engine.submit(r.evolve(request_id=f"{r.request_id}-{n}")) for n, r in
                    enumerate(requests)]
            outs = [j.result(600)[0] for j in jobs]
            batch_sizes[name] = max(o.metrics["batch_requests"] for o in outs)
            return [o.frames for o in outs]
        return run

    def compare(a, b):
        diff = max(int(np.abs(x.astype(int) - y.astype(int)).max()) for x, y in zip(a, b))
        return {"max_pixel_diff": diff, "batched_batch_size": batch_sizes["a"],
                "one_by_one_batch_size": batch_sizes["b"]}

    try:
        record = Case("batching", f"batching_8req_toy_work{args.work}x{args.layers}_{args.steps}steps",
                      "batched", "one_by_one", arm(batched, "a"), arm(single, "b"), goal=ratio_at_most(0.667),
                      reps=7, warmup=1, compare=compare,
                      extra={"batched": "max_num_seqs=8, request_batch_max_wait_ms=20",
                             "one_by_one": "max_num_seqs=1"}).run()
    finally:
        batched.close()
        single.close()
    record["throughput_gain"] = record["b_median_s"] / record["a_median_s"]
    record["met"] = record["met"] and record["max_pixel_diff"] <= 1 and record["batched_batch_size"] == N_REQUESTS
    record["goal"] += " (throughput >= 1.5x) and max_pixel_diff <= 1 and one batch of 8"
    yield record


if __name__ == "__main__":
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--work", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    known, rest = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as tmp_dir:
        raise SystemExit(main(lambda: cases(known, Path(tmp_dir)), rest))
