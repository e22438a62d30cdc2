"""Output writers vs plain one-shot library calls: the overhead our writer adds must be small (ratio ~1.0).

Arm A is ``omnicore.outputs.write_output`` (validation, time-interleaved audio, atomic temp file + rename).
Arm B is written here from scratch: one PyAV loop (or one Pillow call) with the same encoder settings, writing
straight to the target. ``compare`` checks the two files carry the same encoded packets, so the arms do
the same codec work and the ratio measures only the writer's own overhead.

Both arms are single-threaded CPU work, so the goal is on ``cpu_ratio`` (process CPU time), which a busy shared
host disturbs far less than wall time; the wall-clock ``ratio`` is reported beside it and should agree on a
quiet machine.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from _harness import Case, Goal, main
from omnicore.outputs.mp4 import x264_asm_flags
from omnicore.outputs.output import Output
from omnicore.outputs.writers import write_output
from PIL import Image

FRAMES, HEIGHT, WIDTH, FPS, RATE = 9, 192, 320, 24, 48000


def clip() -> np.ndarray:
    y, x = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float64)
    return np.stack(
        [
            np.stack([128 + 90 * np.sin((x + 3 * t) / 40), 128 + 90 * np.cos((y - 2 * t) / 30),
                      128 + 80 * np.sin((x + y + 4 * t) / 50)], -1)
            for t in range(FRAMES)
        ]
    ).round().astype(np.uint8)


def tone() -> np.ndarray:
    t = np.arange(round(FRAMES / FPS * RATE)) / RATE
    return np.stack([0.5 * np.sin(2 * np.pi * 440 * t), 0.5 * np.sin(2 * np.pi * 660 * t)]).astype(np.float32)


def reference_mp4(path: str, frames: np.ndarray, audio: np.ndarray) -> None:
    """The plain PyAV way: all video, then all audio, same encoder settings as our defaults."""
    x264 = {"crf": "18", "preset": "medium", "threads": "1"}
    if x264_asm_flags():
        x264["x264-params"] = f"asm={x264_asm_flags()}"
    with av.open(path, "w", format="mp4", options={"movflags": "+faststart"}) as out:
        vs = out.add_stream("libx264", rate=FPS, options=x264)
        vs.width, vs.height, vs.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        vs.codec_context.time_base = Fraction(1, FPS)
        cc = vs.codec_context
        cc.color_range, cc.colorspace, cc.color_primaries, cc.color_trc = 1, 1, 1, 1
        au = out.add_stream("aac", rate=RATE, layout="stereo", format="fltp")
        au.codec_context.bit_rate = 192_000
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(
                format="yuv420p", dst_colorspace="ITU709", dst_color_range="MPEG"
            )
            frame.pts, frame.time_base = i, Fraction(1, FPS)
            out.mux(vs.encode(frame))
        out.mux(vs.encode(None))
        pcm = av.AudioFrame.from_ndarray(audio, format="fltp", layout="stereo")
        pcm.sample_rate, pcm.pts, pcm.time_base = RATE, 0, Fraction(1, RATE)
        out.mux(au.encode(pcm))
        out.mux(au.encode(None))


def packet_digests(path: Path) -> dict[str, str]:
    with av.open(str(path)) as c:
        digests: dict[str, hashlib._Hash] = {}
        for packet in c.demux():
            if packet.size:
                digests.setdefault(packet.stream.type, hashlib.sha256()).update(bytes(packet))
    return {kind: h.hexdigest() for kind, h in digests.items()}


class Targets:
    """A fresh file name per call (generated outputs normally get new names). Overwriting instead would time the
    filesystem: on ext4 a rename over an existing file forces a data flush (auto_da_alloc) of ~2-3 ms."""

    def __init__(self, folder: Path, stem: str, suffix: str) -> None:
        self.folder, self.stem, self.suffix, self.count = folder, stem, suffix, 0
        self.last: Path | None = None

    def next(self) -> Path:
        self.count += 1
        self.last = self.folder / f"{self.stem}{self.count}{self.suffix}"
        return self.last


def cases():
    work = Path(tempfile.mkdtemp(prefix="omnicore-bench-"))
    frames, audio = clip(), tone()
    video = Output(kind="video", frames=frames, fps=FPS, audio=audio, sample_rate=RATE)
    ours_mp4, ref_mp4 = Targets(work, "ours", ".mp4"), Targets(work, "ref", ".mp4")

    def same_packets(_a, _b) -> dict:
        a, b = packet_digests(ours_mp4.last), packet_digests(ref_mp4.last)
        return {
            "same_video_packets": a.get("video") == b.get("video"),
            "same_audio_packets": a.get("audio") == b.get("audio"),
            "a_bytes": ours_mp4.last.stat().st_size,
            "b_bytes": ref_mp4.last.stat().st_size,
        }

    yield Case(
        "encode_outputs",
        f"mp4_h264_aac_{WIDTH}x{HEIGHT}_{FRAMES}f",
        "write_output",
        "pyav_loop",
        lambda: write_output(video, ours_mp4.next()),
        lambda: reference_mp4(str(ref_mp4.next()), frames, audio),
        goal=Goal("<=", 1.05, metric="cpu_ratio"),
        reps=21,
        compare=same_packets,
    )

    image = Output(kind="image", frames=frames[:1])
    ours_png, ref_png = Targets(work, "ours", ".png"), Targets(work, "ref", ".png")
    yield Case(
        "encode_outputs",
        f"png_{WIDTH}x{HEIGHT}",
        "write_output",
        "pillow_save",
        lambda: write_output(image, ours_png.next()),
        lambda: Image.fromarray(frames[0]).save(ref_png.next(), compress_level=6),
        goal=Goal("<=", 1.05, metric="cpu_ratio"),
        reps=31,
        compare=lambda _a, _b: {"same_bytes": ours_png.last.read_bytes() == ref_png.last.read_bytes()},
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(cases))
