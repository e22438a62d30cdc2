"""``omnicore serve`` as a real process: how it starts, fails and stops (issue 28 §12-§14, §18-§19).

Each test runs the installed ``omnicore`` entry point in a subprocess with its own cache and talks to it
over loopback HTTP; the printed ``try:`` commands are run with the real ``curl``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

EXE = str(Path(sys.executable).with_name("omnicore"))


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_")}
    env.update(OMNICORE_CACHE=str(tmp_path / "cache"), OMNICORE_SHUTDOWN_GRACE_S="5", PYTHONWARNINGS="ignore",
               **extra)
    return env


def _run(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, *args], env=env, capture_output=True, text=True, timeout=timeout)


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error:")]


class Served:
    """A running ``omnicore serve``: its stderr lines as they come, and the port it said it listens on."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([EXE, "serve", *args], env=env, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r}:\n" + "\n".join(self.lines))

    def examples(self) -> list[str]:
        """The curl commands printed under ``try:``."""
        start = self.lines.index("try:")
        return [ln.strip() for ln in self.lines[start + 1:] if ln.strip().startswith("curl ")]

    def stop(self, sig: int) -> int:
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self._reader.join(10)


def test_an_unknown_model_exits_2_within_10_s_with_one_line(tmp_path):
    t0 = time.monotonic()
    r = _run(["serve", "tiny:nope", "--port", "0"], _env(tmp_path))
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: unknown model 'tiny:nope'"), lines
    assert elapsed < 10, elapsed


def test_without_the_server_packages_serve_says_what_to_install(tmp_path):
    """A wheel installed without ``[serve]``: fastapi cannot be imported (a shim on PYTHONPATH makes it so)."""
    shim = tmp_path / "shim" / "fastapi"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'fastapi'\", name='fastapi')\n")
    r = _run(["serve", "tiny:lingbot", "--port", "0"], _env(tmp_path, PYTHONPATH=str(tmp_path / "shim")))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install 'omnicore[serve]'" in lines[0] and "fastapi" in lines[0], lines
    assert "Traceback" not in r.stderr


def test_a_busy_port_exits_2_with_one_line_and_never_says_listening(tmp_path):
    pytest.importorskip("omni_lingbot")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        r = _run(["serve", "tiny:lingbot", "--port", str(port)], _env(tmp_path))
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "already in use" in lines[0] and f"--port {port}" in lines[0], lines
    assert not (tmp_path / "cache" / "presets").exists()  # nothing was loaded


@pytest.mark.slow
def test_a_model_that_fails_to_load_ends_serve_with_exit_2(tmp_path):
    """A checkpoint directory that is recognised but whose weights are broken: the load fails after the
    listener is up; serve must exit 2 with one error line (no traceback), not stay up unhealthy."""
    pytest.importorskip("omni_lingbot")
    from omnicore.config import Settings
    from omnicore.engine.loading import ensure_preset, find_preset
    from omnicore.plugin_host.host import PluginHost

    host = PluginHost(Settings(cache_dir=str(tmp_path / "cache"), plugins=("lingbot",)))
    built = ensure_preset(*find_preset(host, "tiny:lingbot"), tmp_path / "cache")
    broken = tmp_path / "broken-lingbot"
    shutil.copytree(built, broken)
    weights = sorted(broken.rglob("*.safetensors"))
    assert weights
    for w in weights:
        w.write_bytes(b"not a safetensors file")
    t0 = time.monotonic()
    r = _run(["serve", str(broken), "--port", "0"], _env(tmp_path), timeout=180)
    assert r.returncode == 2, r.stderr
    errors = _error_lines(r.stderr)
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot load {broken}"), r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - t0 < 120


def _poll_job(base: str, job_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{base}/v1/videos/{job_id}", timeout=30).json()
        if job["status"] not in ("queued", "in_progress"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s")


@pytest.mark.slow
def test_serve_listens_after_bind_prints_working_examples_and_exits_0_on_sigint(tmp_path):
    pytest.importorskip("omni_lingbot")
    srv = Served(["tiny:lingbot", "--port", "0"], _env(tmp_path))
    try:
        port = int(srv.wait_for(r"^omnicore: listening on http://127\.0\.0\.1:(\d+);", 60).group(1))
        assert port != 0  # the port the OS gave, read from the bound socket
        srv.wait_for(r"^try:$", 180)
        base = f"http://127.0.0.1:{port}"
        ready = next(ln for ln in srv.lines if ln.startswith("omnicore: serving"))
        # no --storage-dir: the default state directory is this model's own
        assert f"state in {tmp_path / 'cache' / 'state' / 'tiny-lingbot'}" in ready, ready
        image_cmd, video_cmd = srv.examples()
        out = subprocess.run(image_cmd, shell=True, capture_output=True, text=True, timeout=300)
        assert json.loads(out.stdout)["data"][0]["b64_json"], out.stdout
        out = subprocess.run(video_cmd, shell=True, capture_output=True, text=True, timeout=120)
        assert _poll_job(base, json.loads(out.stdout)["id"], 300)["status"] == "completed"
    finally:
        code = srv.stop(signal.SIGINT)
    assert code == 0, "\n".join(srv.lines)
    listening = next(i for i, ln in enumerate(srv.lines) if ln.startswith("omnicore: listening"))
    started = next(i for i, ln in enumerate(srv.lines) if "Uvicorn running on" in ln)
    assert started < listening  # said only once the socket was bound


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny:minimax-h3", "tiny:minimax-h3-ref2va"])
def test_the_printed_example_works_for_models_with_required_fields_and_references(tmp_path, preset):
    """t2va needs an aspect ratio and the ref2va partition a reference: the printed request has them."""
    pytest.importorskip("omni_minimax_h3")
    srv = Served([preset, "--port", "0"], _env(tmp_path))
    try:
        port = int(srv.wait_for(r"^omnicore: listening on http://127\.0\.0\.1:(\d+);", 60).group(1))
        srv.wait_for(r"^try:$", 240)
        [video_cmd] = srv.examples()
        out = subprocess.run(video_cmd, shell=True, capture_output=True, text=True, timeout=120)
        body = json.loads(out.stdout)
        assert "id" in body, body
        job = _poll_job(f"http://127.0.0.1:{port}", body["id"], 600)
        assert job["status"] == "completed", job
    finally:
        code = srv.stop(signal.SIGTERM)
    assert code == 0, "\n".join(srv.lines)
