"""Several replicas on one PostgreSQL job store: the store's cost per job, and throughput with 1, 2 and 3 replicas.

Cases (one JSON record each, ``_harness`` conventions):

* ``store_overhead_per_job``: the store calls one tiny job makes over its life, timed as one unit, PostgreSQL (a
  throwaway server from the machine's packages, over 127.0.0.1) vs SQLite (the default store): insert, claim (a
  lease), the reads a claim does (record, request, owner), one fenced progress write per phase and per denoise step
  (4 steps: encode, 4 x denoise, decode, postprocess, encode_output, finalize), the fenced completion, and one
  status read. Arms interleaved. ``a_value``/``b_value`` are the p50 in ms, with p95 beside them; goal: the
  PostgreSQL p50 at most 20 ms per job. The throwaway server runs with ``fsync=off`` (as the tests' does), so the
  PostgreSQL arm excludes the disk flush a durable server adds per commit; SQLite runs as served (WAL, NORMAL).
* ``throughput_2_replicas``, ``throughput_3_replicas``: jobs/s of N real ``omnicore serve tiny:lingbot`` processes
  sharing one database and one directory vs 1 replica, each running 12 jobs (2 steps, 48x48, 5 frames) submitted
  round-robin, 3 interleaved rounds per N (median); replicas that sit out a round are frozen with SIGSTOP (idle,
  they hold no lease). The host's cores are the limit here (each replica gets ``OMP_NUM_THREADS=1``): on 2 shared
  cores 3 replicas cannot be 3x faster. ``a_value``/``b_value`` are jobs/s; ratio = speedup over 1 replica; the
  goal (ratio >= 1, more replicas are not slower) is informational on such a host.

Without PostgreSQL's server binaries or psycopg, every case prints a skip record naming what to install.
Run: ``.venv/bin/python benchmarks/replicas.py [--jobs 12] [--reps 40] [--case store]``. Never part of the tests.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import Goal, emit, quantile, skipped, static_case  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = "replicas"
STEPS = 4  # denoise steps of the store case's job (one fenced write each)


def _missing() -> str | None:
    from omnicore.testing.postgres import INSTALL_HINT, find_bin_dir

    if find_bin_dir() is None:
        return INSTALL_HINT
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError:
        return "psycopg 3 and psycopg_pool are not installed: pip install 'omnicore[postgres]'"
    return None


# ---------------------------------------------------------------------------------------------- store overhead
def _job_life(store: Any, n: int) -> None:
    """The store calls of one job, in the order the server makes them (see the module docstring)."""
    job_id = f"video_bench_{n:06d}"
    now = int(time.time())
    record = {"id": job_id, "object": "video", "status": "queued", "model": "bench", "created_at": now,
              "progress": 0, "phase": "queued"}
    store.insert(record, {"body": {"prompt": "bench", "seed": n}}, owner=None)
    claim = store.claim("bench-holder", ("bench",), 30.0)
    assert claim is not None and claim.job_id == job_id, claim
    store.get(job_id)
    store.get_request(job_id)
    store.get_owner(job_id)
    store.update(job_id, fence=claim.token, total_steps=STEPS)
    phases = ["encode"] + ["denoise"] * STEPS + ["decode", "postprocess", "encode_output", "finalize"]
    for i, phase in enumerate(phases):
        store.update(job_id, fence=claim.token, status="in_progress", phase=phase, step=min(i, STEPS),
                     total_steps=STEPS, progress=i * 8, updated_at=now, queue_position=None)
    store.update(job_id, fence=claim.token, status="completed", phase=None, progress=100, updated_at=now,
                 completed_at=now)
    assert store.get(job_id)["status"] == "completed"


def store_case(reps: int, root: Path, pg_url: str) -> dict[str, Any]:
    from omnicore.jobstore import open_store

    pg = open_store(pg_url, root / "pg-state", storage_url=str(root / "pg-shared"))
    lite = open_store(None, root / "sqlite-state")
    try:
        times: dict[str, list[float]] = {"postgresql": [], "sqlite": []}
        arms: list[tuple[str, Any]] = [("postgresql", pg), ("sqlite", lite)]
        n = 0
        for i in range(reps + 3):  # 3 warm-up jobs per arm, then interleaved A B, B A ...
            for name, store in arms if i % 2 == 0 else arms[::-1]:
                n += 1
                t = time.perf_counter()
                _job_life(store, n)
                if i >= 3:
                    times[name].append(time.perf_counter() - t)
        ms = {k: [v * 1000 for v in vs] for k, vs in times.items()}
        fields = {"a_value": statistics.median(ms["postgresql"]), "b_value": statistics.median(ms["sqlite"]),
                  "unit": "ms per job (p50)", "a_p95_ms": quantile(ms["postgresql"], 0.95),
                  "b_p95_ms": quantile(ms["sqlite"], 0.95), "calls_per_job": 5 + 1 + 4 + STEPS + 1 + 1 + 1,
                  "reps": reps, "loadavg_1m": os.getloadavg()[0]}
        return static_case(BENCH, "store_overhead_per_job", "postgresql", "sqlite", fields,
                           Goal("<=", 20.0, "a_value"))
    finally:
        pg.close()
        lite.close()


# ---------------------------------------------------------------------------------------------- throughput
class _Replica:
    """One ``omnicore serve tiny:lingbot`` process on the shared store (its log in ``root``)."""

    def __init__(self, name: str, pg_url: str, root: Path) -> None:
        import socket
        import subprocess

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = int(sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = root / f"{name}.log"
        env = dict(os.environ, OMNICORE_CACHE=str(root / "cache"), OMNICORE_PLUGINS="lingbot",
                   OMNICORE_LOG_LEVEL="WARNING", OMP_NUM_THREADS="1")
        exe = Path(sys.executable).with_name("omnicore")
        argv = [str(exe), "serve", "tiny:lingbot", "--port", str(self.port), "--store", pg_url, "--storage-url",
                str(root / "shared"), "--state-dir", str(root / f"{name}-state")]
        self._out = open(self.log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._out, stderr=self._out)

    def wait_ready(self, timeout_s: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"replica on {self.url} did not start:\n{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)
        self._out.close()


def _round(replicas: list[_Replica], jobs: int, tag: str) -> float:
    """Submit ``jobs`` round-robin to ``replicas``, wait until all complete; jobs per second."""
    import httpx

    t0 = time.perf_counter()
    ids = []
    for i in range(jobs):
        r = httpx.post(replicas[i % len(replicas)].url + "/v1/videos", timeout=60,
                       json={"prompt": f"{tag} {i}", "num_inference_steps": 2, "seed": i})
        r.raise_for_status()
        ids.append(r.json()["id"])
    pending = set(ids)
    with httpx.Client(base_url=replicas[0].url, timeout=60) as client:
        while pending:
            for vid in list(pending):
                status = client.get(f"/v1/videos/{vid}").json()["status"]
                if status in ("failed", "cancelled"):
                    raise RuntimeError(f"job {vid} ended {status}")
                if status == "completed":
                    pending.discard(vid)
            time.sleep(0.05)
    return jobs / (time.perf_counter() - t0)


def throughput_cases(jobs: int, rounds: int, root: Path, pg_url: str) -> Iterator[dict[str, Any]]:
    replicas: list[_Replica] = []
    try:
        first = _Replica("r1", pg_url, root)
        replicas.append(first)
        first.wait_ready()  # alone: it writes the tiny preset into the shared cache
        replicas += [_Replica(f"r{i}", pg_url, root) for i in (2, 3)]
        for r in replicas[1:]:
            r.wait_ready()
        _round(replicas, 3, "warm-up")  # every replica loaded and warm
        samples: dict[int, list[float]] = {1: [], 2: [], 3: []}
        for k in range(rounds):  # interleaved 1 2 3, 3 2 1, ... so drift in the host's load hits every N alike
            for n in (1, 2, 3) if k % 2 == 0 else (3, 2, 1):
                for i, r in enumerate(replicas):  # the replicas sitting out are frozen (idle: no lease held)
                    r.proc.send_signal(signal.SIGCONT if i < n else signal.SIGSTOP)
                samples[n].append(_round(replicas[:n], jobs, f"r{k}n{n}"))
                print(f"  round {k}: {n} replica(s): {samples[n][-1]:.3f} jobs/s", file=sys.stderr, flush=True)
        rates = {n: statistics.median(v) for n, v in samples.items()}
        for n in (2, 3):
            yield static_case(BENCH, f"throughput_{n}_replicas", f"{n}_replicas", "1_replica",
                              {"a_value": rates[n], "b_value": rates[1], "unit": "jobs/s (median of rounds)",
                               "a_rounds": samples[n], "b_rounds": samples[1], "jobs": jobs,
                               "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
                               "model": "tiny:lingbot, 2 steps, 48x48x5"},
                              Goal(">=", 1.0))
    finally:
        for r in replicas:
            r.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=12, help="jobs per throughput round")
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds per replica count (median kept)")
    ap.add_argument("--reps", type=int, default=40, help="timed jobs per store arm")
    ap.add_argument("--warmup", type=int, default=None, help="(accepted for run_all; the cases warm up themselves)")
    ap.add_argument("--case", action="append", default=[], help="only cases whose name contains this")
    args = ap.parse_args()
    missing = _missing()
    if missing is not None:
        emit(skipped(BENCH, missing))
        return 0
    from omnicore.testing.postgres import ThrowawayPostgres

    wanted: Callable[[str], bool] = lambda name: not args.case or any(s in name for s in args.case)  # noqa: E731
    failed = 0
    with tempfile.TemporaryDirectory(prefix="omnicore-bench-replicas-") as tmp, ThrowawayPostgres() as pg:
        root = Path(tmp)
        if wanted("store_overhead_per_job"):
            try:
                emit(store_case(args.reps, root / "store", pg.new_database("bench_store")))
            except Exception as exc:
                failed += 1
                emit({"benchmark": BENCH, "case": "store_overhead_per_job", "error": f"{exc}", "met": False})
        if wanted("throughput_2_replicas") or wanted("throughput_3_replicas"):
            (root / "procs").mkdir()
            try:
                for record in throughput_cases(args.jobs, args.rounds, root / "procs", pg.new_database("bench_procs")):
                    emit(record)
            except Exception as exc:
                failed += 1
                emit({"benchmark": BENCH, "case": "throughput_*", "error": f"{type(exc).__name__}: {exc}",
                      "met": False})
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
