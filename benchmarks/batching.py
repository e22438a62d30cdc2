"""Engine batching: 8 concurrent small requests on the test-only toy model, batched vs one by one.

Arm "ours": ``max_num_seqs=8`` with a 20 ms admission wait, so the 8 requests form one batch.
Arm "reference": ``max_num_seqs=1`` (no batching; each request runs alone, FIFO).
Both arms submit the same 8 requests (same seeds) at once and time until the last one finishes; the ratio is
reference / ours = the throughput gain of batching (goal >= 1.5). Median of ``--repeats`` runs per arm.

The toy's step cost is a stack of ``work x work`` matmuls on one conditioning vector per sample (weight-
bandwidth bound at small batch, like a DiT at batch 1 on an accelerator) plus a small conv on the latents.
Run: ``python benchmarks/batching.py [--repeats 5] [--work 1024] [--layers 8] [--steps 8]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test-only toy model plugin lives in tests/toy

from omnicore.config import Settings  # noqa: E402
from omnicore.engine.api import Engine  # noqa: E402
from omnicore.engine.request import GenerationRequest, SamplingParams  # noqa: E402
from toy import ToyConfig, build_toy_checkpoint, toy_host  # noqa: E402

N_REQUESTS = 8


def run_arm(ckpt: Path, cache: Path, *, max_num_seqs: int, wait_ms: float, steps: int, repeats: int) -> dict:
    settings = Settings(cache_dir=str(cache), max_num_seqs=max_num_seqs, request_batch_max_wait_ms=wait_ms)
    times, batch_sizes = [], []
    with Engine(str(ckpt), host=toy_host(settings), settings=settings) as engine:
        requests = [GenerationRequest(f"a small scene number {i}", SamplingParams(seed=i, num_inference_steps=steps,
                                                                                   height=32, width=32))
                    for i in range(N_REQUESTS)]
        engine.generate("warm up", seed=0, num_inference_steps=steps)
        for _ in range(repeats):
            start = time.perf_counter()
            jobs = [engine.submit(r.evolve(request_id=f"{r.request_id}-{time.perf_counter_ns()}")) for r in requests]
            outs = [j.result(600) for j in jobs]
            times.append(time.perf_counter() - start)
            batch_sizes.append(max(o[0].metrics["batch_requests"] for o in outs))
    return {"median_s": statistics.median(times), "runs_s": [round(t, 4) for t in times],
            "max_batch_seen": max(batch_sizes)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--work", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_toy_checkpoint(Path(tmp) / "toy", ToyConfig(work=args.work, work_layers=args.layers))
        ours = run_arm(ckpt, Path(tmp) / "cache", max_num_seqs=N_REQUESTS, wait_ms=20.0, steps=args.steps,
                       repeats=args.repeats)
        ref = run_arm(ckpt, Path(tmp) / "cache", max_num_seqs=1, wait_ms=0.0, steps=args.steps,
                      repeats=args.repeats)
    gain = ref["median_s"] / ours["median_s"]
    print(json.dumps({
        "benchmark": "batching",
        "case": f"batching_8req_toy_work{args.work}x{args.layers}_{args.steps}steps",
        "arm_a": "batched", "arm_b": "one_by_one",
        "a_median_s": round(ours["median_s"], 4),
        "b_median_s": round(ref["median_s"], 4),
        "ratio": round(ours["median_s"] / ref["median_s"], 4),
        "throughput_gain": round(gain, 3),
        "goal": "throughput_gain >= 1.5",
        "met": gain >= 1.5,
        "ours": "max_num_seqs=8, request_batch_max_wait_ms=20",
        "reference": "max_num_seqs=1 (one by one)",
        "ours_runs_s": ours["runs_s"], "reference_runs_s": ref["runs_s"],
        "ours_max_batch": ours["max_batch_seen"], "reference_max_batch": ref["max_batch_seen"],
        "repeats": args.repeats,
    }), flush=True)


if __name__ == "__main__":
    main()
