"""The README's "Using it" examples, run as written (issue 14 §7), so the README cannot rot.

Each code block of that section is extracted from README.md and executed in a fresh directory with the
installed ``omnicore`` on ``PATH``: the Python block with this interpreter, the CLI and HTTP blocks with bash.
The only substitutions, in the HTTP block: port 8000 becomes a free port, and the server gets a temporary
``--storage-dir`` (so a developer's own server on the default directory is not disturbed).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # several model loads of the tiny preset

REPO = Path(__file__).resolve().parents[2]


def _blocks() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(python|sh)\n(.*?)```", section, re.S)


def _block(lang: str, needle: str) -> str:
    found = [code for kind, code in _blocks() if kind == lang and needle in code]
    assert len(found) == 1, f"expected one {lang} block containing {needle!r} in README's 'Using it'"
    return found[0]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMNICORE_") or k == "OMNICORE_CACHE"}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _run(cmd: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd[:2]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def test_python_example(tmp_path):
    _run([sys.executable, "-c", _block("python", "omnicore.Engine")], tmp_path)
    assert (tmp_path / "fox.mp4").stat().st_size > 0


def test_cli_examples(tmp_path):
    code = _block("sh", "omnicore generate")
    _run(["bash", "-euo", "pipefail", "-c", code], tmp_path)
    for name in ("ref.png", "fox.mp4", "i2v.mp4", "cached.png"):
        assert (tmp_path / name).stat().st_size > 0, name


def test_http_examples(tmp_path):
    code = _block("sh", "omnicore serve")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert code.count("--port 8000") == 1
    code = code.replace("--port 8000", f"--port {port} --storage-dir {tmp_path / 'state'}")
    code = code.replace("localhost:8000", f"localhost:{port}")
    # The block starts the server in the background: run it in its own process group with output to files
    # (a pipe would stay open in a server the block left behind), and stop the whole group afterwards.
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as fo, open(err, "w") as fe:
        proc = subprocess.Popen(["bash", "-eo", "pipefail", "-c", code], cwd=tmp_path, env=_env(), stdout=fo,
                                stderr=fe, start_new_session=True)
        try:
            rc = proc.wait(timeout=600)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the group (normally nothing)
            except ProcessLookupError:
                pass
    stdout = out.read_text()
    assert rc == 0, f"exit {rc}:\n{stdout[-3000:]}\n{err.read_text()[-5000:]}"
    assert "saved fox.mp4" in stdout, stdout[-2000:]
    assert (tmp_path / "fox.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = (tmp_path / "fox.mp4").read_bytes()
    assert data[4:8] == b"ftyp", data[:16]  # an MP4, not an error body
