"""Untrusted uploads against real ``omnicore serve`` processes (issue 28 items 1, 2 and the image bomb of item 10).

Each server is a subprocess, so a codec crash shows as a dead process (not a dead test runner), and the memory a
request costs is measured where it is spent: the server's peak RSS (``VmHWM``, reset through ``clear_refs``)
minus its RSS before the request.

Budgets per request (peak RSS above the RSS before it), stated here and asserted below:

- a 1000-frame 544x544 H.264 ``reference_video`` to a deployment that serves no references: 120 MB
  (its frames alone are ~888 MB; the deployment refuses it before any frame is decoded)
- three of those requests at once (per server): 120 MB in all
- 4 of those videos to ref2va, which takes at most 3: 120 MB (refused before any decode)
- the same video accepted by ref2va, the whole job (submission to completion): 400 MB (only the ~100 source
  frames its 4 s reach are decoded, when it runs)
- four such jobs at once (one running, three queued): 300 MB of RSS held in all
- a 50 MP PNG as ``input_reference``: 600 MB (its RGB pixels alone are 150 MB; Pillow decodes, the model
  resizes it onto its small canvas)
"""

from __future__ import annotations

import base64
import io
import os
import socket
import struct
import subprocess
import sys
import time
import wave
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest

pytest.importorskip("omni_minimax_h3", reason="the MiniMax-H3 plugin (plugins/minimax_h3) is not installed")
av = pytest.importorskip("av")
pytestmark = pytest.mark.slow

MB = 1_000_000
BUDGET_REFUSED_VIDEO = 120 * MB
BUDGET_50MP_PNG = 600 * MB
BUDGET_RUNNING_VIDEO = 400 * MB
BUDGET_QUEUED_JOBS = 300 * MB
BASE = {"prompt": "rain on a tin roof", "seconds": "4", "seed": "3", "num_inference_steps": "1"}


# ------------------------------------------------------------------------------------------------ servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    """One ``omnicore serve`` subprocess on loopback."""

    def __init__(self, tmp: Path, model: str, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("omnicore")
        env = dict(os.environ, OMNICORE_CACHE=str(tmp / "cache"), OMNICORE_PLUGINS="minimax_h3")
        self.log = open(tmp / "server.log", "w+")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([str(exe), "serve", model, "--port", str(self.port), "--state-dir",
                                      str(tmp / "state"), *flags], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            assert self.proc.poll() is None, self.output()
            assert time.monotonic() < deadline, "the server did not become ready"
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def alive_and_healthy(self) -> bool:
        return self.proc.poll() is None and httpx.get(self.url + "/health", timeout=5).status_code == 200

    def _status(self, key: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise KeyError(key)

    def peak_cost(self, send: object) -> tuple[int, httpx.Response]:
        """Bytes of RSS the server's peak rose above its RSS before ``send()`` (a callable doing the request)."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")  # VmHWM := VmRSS now
        before = self._status("VmRSS")
        resp = send()  # type: ignore[operator]
        time.sleep(0.2)
        return self._status("VmHWM") - before, resp

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def fl2va(tmp_path_factory):
    """``tiny:minimax-h3``: the FL2VA partition, serving t2va and fl2va (no references)."""
    s = Served(tmp_path_factory.mktemp("h3-fl2va"), "tiny:minimax-h3", "--max-decode-bytes", str(250 * MB))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref2va(tmp_path_factory):
    """``tiny:minimax-h3-ref2va``: the Ref2VA partition (references: at most 3 videos)."""
    s = Served(tmp_path_factory.mktemp("h3-ref2va"), "tiny:minimax-h3-ref2va")
    yield s
    s.stop()


# ------------------------------------------------------------------------------------------------ media
def _wav(channels: int, seconds: float = 2.5, rate: int = 16000) -> bytes:
    n = int(seconds * rate)
    t = np.arange(n) / rate
    pcm = np.stack([0.2 * np.sin(2 * np.pi * (220 + 110 * c) * t) for c in range(channels)], axis=1)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((pcm * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _png(width: int, height: int, *, rows: int | None = None, value: int = 90) -> bytes:
    """An RGB PNG of one colour, written row by row (the test never holds its pixels); ``rows`` < ``height``
    truncates the pixel data (a header that promises more than the file holds)."""
    z = zlib.compressobj(9)
    row = b"\x00" + bytes([value]) * (3 * width)
    body = b"".join(z.compress(row) for _ in range(height if rows is None else rows)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr) + _png_chunk(b"IDAT", body) + _png_chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def long_video() -> bytes:
    """1000 frames of 544x544 H.264 (a few tens of KB; ~888 MB once decoded to RGB)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as c:
        s = c.add_stream("libx264", rate=24)
        s.width = s.height = 544
        s.pix_fmt = "yuv420p"
        s.options = {"preset": "ultrafast", "crf": "40"}
        base = np.full((544, 544, 3), 80, np.uint8)
        for i in range(1000):
            base[:8, :8] = i % 256
            frame = av.VideoFrame.from_ndarray(base, format="rgb24")
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return buf.getvalue()


def _url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _wait_done(url: str, job_id: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{url}/v1/videos/{job_id}", timeout=10).json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish")


# ------------------------------------------------------------------------------------------------ item 1
def test_multichannel_reference_audio_is_downmixed_and_too_many_channels_refused(ref2va):
    """An 8-channel WAV (PyAV's planar 8-channel frames crashed the process in ``to_ndarray``): accepted and
    downmixed to the stereo H3 takes, by multipart and by data URL; beyond 16 channels a 400 naming the field."""
    image = ("reference_images", ("r.png", _png(320, 256), "image/png"))
    r = httpx.post(ref2va.url + "/v1/videos", data=BASE, timeout=60,
                   files=[image, ("reference_audio", ("8ch.wav", _wav(8), "audio/wav"))])
    assert r.status_code == 200, r.text
    assert ref2va.alive_and_healthy(), ref2va.output()
    body = {**BASE, "reference_images": [{"image_url": _url("image/png", _png(320, 256))}],
            "reference_audio": [{"audio_url": _url("audio/wav", _wav(8))}]}
    r2 = httpx.post(ref2va.url + "/v1/videos", json=body, timeout=60)
    assert r2.status_code == 200, r2.text
    assert _wait_done(ref2va.url, r.json()["id"])["status"] == "completed"
    assert _wait_done(ref2va.url, r2.json()["id"])["status"] == "completed"

    r = httpx.post(ref2va.url + "/v1/videos", data=BASE, timeout=60,
                   files=[image, ("reference_audio", ("24ch.wav", _wav(24, seconds=0.2), "audio/wav"))])
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "reference_audio" and "24 audio channels" in err["message"], err
    assert ref2va.alive_and_healthy(), ref2va.output()


# ------------------------------------------------------------------------------------------------ item 2
def test_video_reference_to_a_deployment_without_references_is_refused_before_decoding(fl2va, long_video):
    cost, r = fl2va.peak_cost(lambda: httpx.post(fl2va.url + "/v1/videos", data=BASE, timeout=120, files=[
        ("reference_video", ("long.mp4", long_video, "video/mp4"))]))
    assert r.status_code == 400, r.text
    print(f"\n1000-frame 544x544 reference_video to tiny:minimax-h3: peak +{cost / MB:.0f} MB")
    assert cost < BUDGET_REFUSED_VIDEO, f"+{cost / MB:.0f} MB"
    assert fl2va.alive_and_healthy()


def test_three_refused_video_references_at_once_stay_within_the_budget(fl2va, long_video):
    """Per server: three such requests in flight together (each ~888 MB of frames) cost no more than one."""
    from concurrent.futures import ThreadPoolExecutor

    def send() -> list[httpx.Response]:
        with ThreadPoolExecutor(3) as pool:
            return list(pool.map(lambda _: httpx.post(fl2va.url + "/v1/videos", data=BASE, timeout=120, files=[
                ("reference_video", ("long.mp4", long_video, "video/mp4"))]), range(3)))

    cost, answers = fl2va.peak_cost(send)
    assert [a.status_code for a in answers] == [400, 400, 400], [a.text for a in answers]
    print(f"\n3 concurrent refused 1000-frame reference_video: peak +{cost / MB:.0f} MB")
    assert cost < BUDGET_REFUSED_VIDEO, f"+{cost / MB:.0f} MB"


def test_four_videos_to_ref2va_are_refused_before_decoding(ref2va, long_video):
    files = [("reference_video", (f"v{i}.mp4", long_video, "video/mp4")) for i in range(4)]
    cost, r = ref2va.peak_cost(lambda: httpx.post(ref2va.url + "/v1/videos", data=BASE, files=files, timeout=120))
    assert r.status_code == 400, r.text
    assert "at most 3" in r.json()["error"]["message"], r.text
    print(f"\n4 x 1000-frame reference_video to tiny:minimax-h3-ref2va: peak +{cost / MB:.0f} MB")
    assert cost < BUDGET_REFUSED_VIDEO, f"+{cost / MB:.0f} MB"
    assert ref2va.alive_and_healthy()


def test_a_long_reference_video_costs_only_the_frames_the_job_reads(ref2va, long_video):
    """Accepted with its frames still compressed; when the job runs, only the source frames its 4 s reach are
    decoded (~100 of the 1000; ~888 MB if all were), so the whole job stays within its budget."""
    def run() -> httpx.Response:
        r = httpx.post(ref2va.url + "/v1/videos", data=BASE, timeout=120,
                       files=[("reference_video", ("long.mp4", long_video, "video/mp4"))])
        assert r.status_code == 200, r.text
        assert _wait_done(ref2va.url, r.json()["id"])["status"] == "completed"
        return r

    cost, _ = ref2va.peak_cost(run)
    print(f"\n1000-frame reference_video, whole ref2va job: peak +{cost / MB:.0f} MB")
    assert cost < BUDGET_RUNNING_VIDEO, f"+{cost / MB:.0f} MB"


def test_queued_jobs_hold_their_uploads_not_their_decoded_frames(ref2va, long_video):
    """Four jobs with a 1000-frame reference each (one running, three queued) hold ~100 MB together (each held
    ~900 MB of decoded frames before)."""
    before = ref2va._status("VmRSS")
    ids = []
    for _ in range(4):
        r = httpx.post(ref2va.url + "/v1/videos", data={**BASE, "num_inference_steps": "50"}, timeout=120,
                       files=[("reference_video", ("long.mp4", long_video, "video/mp4"))])
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"])
    time.sleep(1)
    held = ref2va._status("VmRSS") - before
    for job_id in ids:
        httpx.post(f"{ref2va.url}/v1/videos/{job_id}/cancel", timeout=120)
    print(f"\n4 jobs with a 1000-frame reference (1 running, 3 queued): RSS +{held / MB:.0f} MB held")
    assert held < BUDGET_QUEUED_JOBS, f"+{held / MB:.0f} MB"
    for job_id in ids:
        assert _wait_done(ref2va.url, job_id)["status"] in ("cancelled", "completed")


def test_a_50_megapixel_png_stays_within_its_budget(fl2va):
    png = _png(7000, 7000)  # 49 MP, a few hundred KB
    assert len(png) < 1_000_000
    cost, r = fl2va.peak_cost(lambda: httpx.post(fl2va.url + "/v1/videos", data=BASE, timeout=120, files=[
        ("input_reference", ("big.png", png, "image/png"))]))
    assert r.status_code == 200, r.text
    print(f"\n49 MP PNG as input_reference to tiny:minimax-h3: peak +{cost / MB:.0f} MB")
    assert cost < BUDGET_50MP_PNG, f"+{cost / MB:.0f} MB"
    assert _wait_done(fl2va.url, r.json()["id"])["status"] == "completed"


def test_a_30000_square_png_is_image_too_large_from_its_header(fl2va):
    """Pillow's own bomb limit (~89 MP) used to answer ``invalid_media (DecompressionBombError)``."""
    bomb = _png(30000, 30000, rows=2)  # the header promises 900 MP; the file holds two rows
    cost, r = fl2va.peak_cost(lambda: httpx.post(fl2va.url + "/v1/videos", data=BASE, timeout=60, files=[
        ("input_reference", ("bomb.png", bomb, "image/png"))]))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("image_too_large", "input_reference"), err
    assert "30000x30000" in err["message"] and cost < 50 * MB


def test_decode_budget_answers_400_alone_and_429_while_queued_jobs_hold_it(fl2va):
    """``--max-decode-bytes 250 MB`` on this server: two 49 MP keyframes (2 x 147 MB of RGB) in one request exceed
    it alone; one fits, but not a second while the first job holds its share."""
    png = _png(7000, 7000)
    keyframes = [("input_reference", ("a.png", png, "image/png")), ("last_frame", ("b.png", png, "image/png"))]
    r = httpx.post(fl2va.url + "/v1/videos", data=BASE, timeout=60, files=keyframes)
    assert r.status_code == 400 and r.json()["error"]["code"] == "decode_too_large", r.text
    assert "--max-decode-bytes" in r.json()["error"]["message"]
    first = httpx.post(fl2va.url + "/v1/videos", data={**BASE, "num_inference_steps": "40"}, timeout=120,
                       files=keyframes[:1])
    assert first.status_code == 200, first.text
    r = httpx.post(fl2va.url + "/v1/videos", data=BASE, timeout=120, files=keyframes[1:])
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "decode_budget_exhausted" and r.headers.get("retry-after"), r.text
    httpx.post(f"{fl2va.url}/v1/videos/{first.json()['id']}/cancel", timeout=60)
    assert _wait_done(fl2va.url, first.json()["id"])["status"] in ("cancelled", "completed")
    time.sleep(0.5)
    r = httpx.post(fl2va.url + "/v1/videos", data=BASE, timeout=120, files=keyframes[1:])
    assert r.status_code == 200, r.text  # the finished job gave its share back
    assert _wait_done(fl2va.url, r.json()["id"])["status"] == "completed"
