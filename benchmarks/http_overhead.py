"""HTTP overhead of ``omnicore serve``: p50 latency of a tiny T2I request through HTTP minus a direct engine call.

Arms, per case (same prompt, size, steps and seed):
  * ``direct``: ``engine.submit(request).result()`` in this process, plus the PNG + base64 encoding the HTTP
    response also does (so the difference is the HTTP edge: parsing, validation, threads, JSON, sockets);
  * ``http``: ``POST /v1/images/generations`` with httpx (keep-alive) to a server in a separate process
    (uvicorn + create_app around an identical toy engine), so client and server do not share a GIL.

Prints one JSON object per case: both medians (ms), the overhead (ms) and the ratio. Goal: overhead <= 10 ms.
Run: ``.venv/bin/python benchmarks/http_overhead.py [--iters 40]``. Never part of the test suite.

Both processes run torch with one intra-op thread (``OMP_NUM_THREADS=1`` unless you set it): two OpenMP pools
spinning on a 2-core box otherwise dominate both arms (direct 1.7 ms becomes ~20 ms) and the comparison
measures scheduler noise instead of the HTTP edge.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (see the docstring)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test-only toy model plugin

CASES = [
    {"name": "t2i-32x32-1step", "size": (32, 32), "steps": 1},
    {"name": "t2i-64x64-4steps", "size": (64, 64), "steps": 4},
]


def _engine(cache: str):
    from toy import toy_engine

    return toy_engine(cache)


def serve(cache: str, state: str, port_file: str) -> None:
    import threading

    import uvicorn
    from omnicore.server import ServerSettings, create_app

    app = create_app(_engine(cache), ServerSettings(state_dir=state))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))

    def announce() -> None:
        while not server.started:
            time.sleep(0.01)
        Path(port_file).write_text(str(server.servers[0].sockets[0].getsockname()[1]))

    threading.Thread(target=announce, daemon=True).start()
    server.run()


def _p50(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--serve", nargs=3, metavar=("CACHE", "STATE", "PORT_FILE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(*args.serve)
        return

    import httpx
    from omnicore.engine.request import GenerationRequest, SamplingParams
    from omnicore.outputs.writers import encode_output

    tmp = Path(tempfile.mkdtemp(prefix="omnicore-bench-"))
    cache, port_file = str(tmp / "cache"), str(tmp / "port")
    engine = _engine(cache)  # builds the preset once; the server reuses the cache
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, __file__, "--serve", cache, str(tmp / "state"), port_file], env=env)
    try:
        deadline = time.monotonic() + 120
        while not Path(port_file).exists() or not Path(port_file).read_text():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the benchmark server did not start")
            time.sleep(0.05)
        url = f"http://127.0.0.1:{Path(port_file).read_text()}"
        with httpx.Client(base_url=url, timeout=120) as client:
            for case in CASES:
                w, h = case["size"]
                body = {"prompt": "a small benchmark scene", "size": f"{w}x{h}",
                        "num_inference_steps": case["steps"], "seed": 0}

                def direct() -> None:
                    req = GenerationRequest(prompt=body["prompt"], params=SamplingParams(
                        width=w, height=h, num_frames=1, num_inference_steps=case["steps"], seed=0,
                        output_type="image"))
                    out = engine.submit(req).result(120)[0]
                    base64.b64encode(encode_output(out, "png"))

                def http() -> None:
                    r = client.post("/v1/images/generations", json=body)
                    r.raise_for_status()
                    r.json()

                for fn in (direct, http):  # warm-up
                    for _ in range(3):
                        fn()
                d_s: list[float] = []
                h_s: list[float] = []
                for _ in range(args.iters):  # interleave the arms so drift hits both equally
                    for fn, acc in ((direct, d_s), (http, h_s)):
                        t = time.perf_counter()
                        fn()
                        acc.append(time.perf_counter() - t)
                d50, h50 = _p50(d_s), _p50(h_s)
                print(json.dumps({
                    "benchmark": "http_overhead", "case": case["name"], "arm_a": "http", "arm_b": "direct_engine",
                    "a_median_s": round(h50 / 1000.0, 6), "b_median_s": round(d50 / 1000.0, 6),
                    "ratio": round(h50 / d50, 3), "goal": "overhead_p50_ms <= 10", "met": h50 - d50 <= 10.0,
                    "iters": args.iters, "direct_p50_ms": round(d50, 3),
                    "http_p50_ms": round(h50, 3), "overhead_p50_ms": round(h50 - d50, 3),
                    "ratio_http_over_direct": round(h50 / d50, 3), "goal_overhead_ms": 10.0,
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                }), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
        engine.close()


if __name__ == "__main__":
    main()
