"""The README's "Several servers" block, run as written behind a round-robin load balancer, so it cannot rot.

The block is extracted from README.md and run with bash. The only substitutions: the database URL becomes a
throwaway PostgreSQL database, the shared directory and the state directories go under a temporary directory,
the three ports become free ones and ``--host 0.0.0.0`` becomes loopback. The load balancer is a small
round-robin HTTP proxy in this file (standing in for nginx or any other): every request goes to the next replica,
so a job is created, polled, streamed, downloaded and deleted through different replicas. Jobs are tiny
(tiny:lingbot, random weights: the output is noise).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from _replica_procs import free_port, leases, wait_all
from _server_helpers import read_events

pytest.importorskip("omni_lingbot", reason="the LingBot plugin (plugins/lingbot) is not installed")
pytestmark = pytest.mark.slow  # three model loads and a few jobs

REPO = Path(__file__).resolve().parents[2]
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "upgrade",
              "proxy-connection", "content-encoding"}


def readme_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Several servers\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "expected one sh block in README's 'Several servers'"
    return str(blocks[0])


def substitute(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"README's 'Several servers' block should contain {old!r} once"
    return code.replace(old, new)


class RoundRobin(ThreadingHTTPServer):
    """Forwards each request to the next backend, streaming the response body (SSE included)."""

    daemon_threads = True

    def __init__(self, backends: list[str]) -> None:
        self.backends = itertools.cycle(backends)
        self.served: Counter[str] = Counter()
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Forward)

    def next_backend(self) -> str:
        with self.lock:
            url = next(self.backends)
            self.served[url] += 1
            return url


class _Forward(BaseHTTPRequestHandler):
    server: RoundRobin

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        upstream = self.server.next_backend()
        with httpx.Client(timeout=120) as client, \
                client.stream(self.command, upstream + self.path, content=body, headers=headers) as resp:
            self.send_response(resp.status_code)
            for k, v in resp.headers.items():
                if k.lower() not in HOP_BY_HOP:
                    self.send_header(k, v)
            self.send_header("Connection", "close")
            self.end_headers()
            for chunk in resp.iter_raw():
                self.wfile.write(chunk)
                self.wfile.flush()

    do_GET = do_POST = do_DELETE = _forward

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def replicas(postgres: Any, tmp_path: Path) -> Iterator[tuple[list[str], str, Path]]:
    """The README block running (three replicas); yields their URLs, the store URL and the shared directory."""
    pg_url = postgres.new_database("readme_replicas")
    shared = tmp_path / "shared"
    ports = [free_port() for _ in range(3)]
    code = readme_block()
    code = substitute(code, "postgresql://omnicore@db.example:5432/omnicore", pg_url)
    code = substitute(code, "file:///mnt/omnicore", f"file://{shared}")
    code = substitute(code, "8001 8002 8003", " ".join(map(str, ports)))
    code = substitute(code, "/var/lib/omnicore/", f"{tmp_path}/state/")
    code = substitute(code, "--host 0.0.0.0", "--host 127.0.0.1")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    env.update(PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
               OMNICORE_CACHE=str(tmp_path / "cache"), OMNICORE_PLUGINS="lingbot", OMNICORE_LOG_LEVEL="WARNING")
    log = tmp_path / "replicas.log"
    with open(log, "w") as out:
        # its own process group: the block's servers run in the background; the group is stopped afterwards
        proc = subprocess.Popen(["bash", "-euo", "pipefail", "-c", code + "\nwait\n"], cwd=tmp_path, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        deadline = time.monotonic() + 300
        for url in urls:
            while True:
                assert proc.poll() is None, log.read_text()[-5000:]
                assert time.monotonic() < deadline, f"{url} not ready:\n{log.read_text()[-5000:]}"
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
        yield urls, pg_url, shared
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_readme_replicas_behind_a_round_robin_balancer(replicas: tuple[list[str], str, Path]) -> None:
    urls, pg_url, shared = replicas
    lb = RoundRobin(urls)
    threading.Thread(target=lb.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{lb.server_address[1]}"
    try:
        with httpx.Client(base_url=base, timeout=60) as client:
            bodies = [{"prompt": f"clip {i}", "num_inference_steps": 1 if i < 5 else 6, "seed": i}
                      for i in range(6)]
            ids = []
            for body in bodies:
                r = client.post("/v1/videos", json=body)
                assert r.status_code == 200, r.text
                ids.append(r.json()["id"])
            with client.stream("GET", f"/v1/videos/{ids[-1]}/events") as resp:  # a 6-step job, streamed live
                assert resp.status_code == 200
                events = read_events(resp)
            done = wait_all(client, ids, 300)
            assert all(j["status"] == "completed" for j in done.values()), done
            assert events[-1]["event"] == "video.completed" and events[-1]["data"]["id"] == ids[-1]
            assert any(e["event"] == "video.progress" for e in events), [e["event"] for e in events]
            assert all(leases(pg_url)[v] == (1, 1) for v in ids)  # each job claimed once
            # --checkpoint-every 5: the 6-step job wrote one at step 5 (the directory exists), removed at its end
            assert (shared / "checkpoints").is_dir() and not list((shared / "checkpoints").iterdir())
            for vid in ids:
                whole = client.get(f"/v1/videos/{vid}/content")
                assert whole.status_code == 200 and whole.content[4:8] == b"ftyp"
                for url in urls:  # every replica serves the same bytes, and byte ranges
                    assert httpx.get(f"{url}/v1/videos/{vid}/content", timeout=60).content == whole.content
                part = client.get(f"/v1/videos/{vid}/content", headers={"Range": "bytes=10-99"})
                assert part.status_code == 206 and part.content == whole.content[10:100]
            r = client.delete(f"/v1/videos/{ids[0]}")
            assert r.status_code == 200 and r.json()["deleted"] is True, r.text
            for url in urls:
                assert httpx.get(f"{url}/v1/videos/{ids[0]}", timeout=60).status_code == 404
            assert not list((shared / "results").glob(f"{ids[0]}.*"))
    finally:
        lb.shutdown()
        lb.server_close()
    assert set(lb.served) == set(urls)  # the balancer really spread the requests over the three replicas
