"""Real ``omnicore serve`` replicas on loopback for the multi-replica tests (``from _replica_procs import ...``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

TERMINAL = ("completed", "failed", "cancelled")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Replica:
    """One ``omnicore serve tiny:lingbot --store <pg> --storage-url <shared>`` process, its output in a log file."""

    def __init__(self, name: str, *, pg_url: str, shared: Path, root: Path, cache: Path, lease_s: float,
                 extra: tuple[str, ...] = ()) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = root / f"{name}.log"
        exe = Path(sys.executable).with_name("omnicore")
        env = dict(os.environ, OMNICORE_CACHE=str(cache), OMNICORE_PLUGINS="lingbot", OMNICORE_LOG_LEVEL="WARNING")
        argv = [str(exe), "serve", "tiny:lingbot", "--port", str(self.port), "--store", pg_url, "--storage-url",
                str(shared), "--state-dir", str(root / f"{name}-state"), "--lease", str(lease_s), "--cancel-wait",
                "20", "--shutdown-grace", "2", *extra]
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.alive(), self.log()
            assert time.monotonic() < deadline, f"{self.name} did not become ready:\n{self.log()}"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.alive():
            try:
                self.proc.send_signal(signal.SIGCONT)
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._log.close()


def wait_all(client: httpx.Client, ids: list[str], timeout_s: float) -> dict[str, dict[str, Any]]:
    """Poll until every job is terminal; returns the final records by id."""
    deadline = time.monotonic() + timeout_s
    done: dict[str, dict[str, Any]] = {}
    while len(done) < len(ids):
        assert time.monotonic() < deadline, f"{len(ids) - len(done)} jobs not finished in {timeout_s} s"
        for vid in ids:
            if vid not in done:
                job = client.get(f"/v1/videos/{vid}").json()
                if job["status"] in TERMINAL:
                    done[vid] = job
        time.sleep(0.2)
    return done


def holder_pid(store_url: str, job_id: str) -> int | None:
    """The pid of the replica holding ``job_id``'s lease now (the holder id is ``host:pid:random``)."""
    import psycopg

    with psycopg.connect(store_url) as conn:
        row = conn.execute("SELECT lease_owner FROM jobs WHERE id = %s AND lease_expires > now()",
                           (job_id,)).fetchone()
    return int(row[0].split(":")[1]) if row and row[0] else None


def leases(store_url: str) -> dict[str, tuple[int, int]]:
    """``job id -> (lease_token, claims)`` of every job."""
    import psycopg

    with psycopg.connect(store_url) as conn:
        return {r[0]: (int(r[1]), int(r[2])) for r in conn.execute("SELECT id, lease_token, claims FROM jobs")}
