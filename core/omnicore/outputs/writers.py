"""Write an :class:`Output` to disk or to bytes; the file suffix (or ``fmt``) picks the container.

Writers take any :class:`~.checks.Encodable` (the ``Output`` record is one) and never import ``output.py``, so
the dependency runs one way: ``Output.save`` -> writers.

Images: ``.png`` (lossless), ``.webp`` (lossy, or exact with ``EncodeOptions(webp_lossless=True)``),
``.jpg``/``.jpeg``. Video: ``.mp4`` (H.264 + AAC, see :mod:`.mp4`). A video output may be saved as an
image only when it has exactly one frame. Files are written atomically: a temp file in the target folder
is filled, then renamed over the target, so readers never see half a file (``EncodeOptions(durable=True)``
also fsyncs it first, for files that must survive a power cut).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ..errors import InvalidRequest

if TYPE_CHECKING:
    import numpy as np
from .checks import Encodable, check_frames
from .images import encode_image, save_image
from .mp4 import write_mp4
from .options import DEFAULT_OPTIONS, EncodeOptions

# suffix / format name -> canonical format
FORMATS: dict[str, str] = {"png": "png", "webp": "webp", "jpg": "jpeg", "jpeg": "jpeg", "mp4": "mp4"}
SUPPORTED_SUFFIXES = tuple(f".{name}" for name in FORMATS)


def format_for(name: str, *, field: str = "format") -> str:
    """Canonical format for a suffix or format name (``".JPG"`` -> ``"jpeg"``); errors list what is supported."""
    key = name.lower().lstrip(".")
    if key not in FORMATS:
        shown = name or "(none)"
        raise InvalidRequest(field, f"unsupported output format {shown!r}; supported: {', '.join(SUPPORTED_SUFFIXES)}")
    return FORMATS[key]


def _still_frame(output: Encodable, fmt: str) -> np.ndarray:
    frames = check_frames(output.frames)
    if frames.shape[0] != 1:
        raise InvalidRequest(
            "frames", f"a .{fmt} file holds one image but this {output.kind} output has {frames.shape[0]} frames; "
            "save it as .mp4 or select one frame"
        )
    return frames[0]


def _write_atomic(path: Path, fill: Callable[[str, BinaryIO], None], durable: bool) -> Path:
    """Create a temp file beside ``path``, ``fill(temp_path, open_file)`` it, then rename it onto ``path``
    (same folder, so the rename is atomic). On any failure the temp file is removed and ``path`` is untouched."""
    if not path.parent.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.part"
    # O_EXCL: never reuse someone else's file; mode 0o666 minus umask gives the final file ordinary permissions.
    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fill(os.fspath(tmp), fh)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_output(output: Encodable, path: str | os.PathLike[str], options: EncodeOptions = DEFAULT_OPTIONS) -> Path:
    """Write ``output`` to ``path`` in the format its suffix names; returns the path written."""
    path = Path(path)
    fmt = format_for(path.suffix, field="path")
    if fmt == "mp4":
        # PyAV writes by name (faststart re-reads the file), so the open handle is left alone; a durable fsync
        # through it still covers the data, since fsync acts on the file, not on the descriptor's writes.
        def fill_mp4(tmp: str, _fh: BinaryIO) -> None:
            write_mp4(tmp, output.frames, output.fps, output.audio, output.sample_rate, options)

        return _write_atomic(path, fill_mp4, options.durable)
    frame = _still_frame(output, fmt)
    return _write_atomic(path, lambda _tmp, fh: save_image(frame, fmt, fh, options), options.durable)


def encode_output(output: Encodable, fmt: str, options: EncodeOptions = DEFAULT_OPTIONS) -> bytes:
    """Encode ``output`` in memory as ``fmt`` (``"png"``, ``"webp"``, ``"jpeg"``/``"jpg"``, ``"mp4"``)."""
    fmt = format_for(fmt)
    if fmt != "mp4":
        return encode_image(_still_frame(output, fmt), fmt, options)
    # The MP4 muxer's faststart pass re-reads its output by name, so go through a private temp file.
    with tempfile.TemporaryDirectory(prefix="omnicore-mp4-") as tmpdir:
        tmp = os.path.join(tmpdir, "out.mp4")
        write_mp4(tmp, output.frames, output.fps, output.audio, output.sample_rate, options)
        with open(tmp, "rb") as fh:
            return fh.read()
