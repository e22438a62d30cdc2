"""Helpers of the multi-process (worker group) tests, importable from any test (``from _worker_group_helpers import
pids_gone``): whether processes are gone, this process's children, the bytes a sharding plan splits in a
checkpoint folder (what a rank that reads only its shard skips), and code run at the start of every spawned worker
(:func:`at_worker_start`, e.g. to inject a fault on a worker rank)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: bytes per element of the safetensors dtypes the tiny presets write
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4}


def pids_gone(pids: list[int], wait_s: float = 20.0) -> bool:
    """No process with these ids runs (a zombie counts as gone: its old parent may not reap it), waiting up to
    ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for pid in pids:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue
            if state != "Z":
                alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return not alive
        time.sleep(0.2)


def child_pids() -> set[int]:
    """This process's live children, less multiprocessing's resource tracker (it lives as long as this process)."""
    me = os.getpid()
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            try:
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"resource_tracker" not in cmdline:
                found.add(int(stat.parent.name))
    return found


def planned_file_bytes(folder: Path, plan: Any) -> tuple[int, int]:
    """``(bytes of every stored tensor, bytes of those plan splits)`` of the ``*.safetensors`` files in ``folder``,
    from the headers alone (``plan.param_split(module, param)`` over the stored names, as the sharded readers
    match them). A rank of ``P`` that reads only its shard reads ``total - split + split / P``."""
    from safetensors import safe_open

    total = split = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                view = f.get_slice(name)
                n = DTYPE_BYTES[view.get_dtype()]
                for size in view.get_shape():
                    n *= size
                total += n
                module, _, param = name.rpartition(".")
                split += n if plan.param_split(module, param) is not None else 0
    return total, split


@contextmanager
def at_worker_start(tmp_path: Path, call: str, **env: str) -> Iterator[None]:
    """Inside the block, every worker process a ``multiprocessing`` spawn starts (the ranks of an ``Engine`` built
    here) calls ``call`` (``"module:function"``, a test helper module) as its interpreter starts, before it
    unpickles its task: a ``sitecustomize`` module on ``PYTHONPATH`` does it. ``env`` is set for the block too (the
    workers read it then). Lets a test change what runs on a worker rank, e.g. inject a fault there; processes
    that are not spawn workers (the resource tracker) skip the call."""
    import importlib.util

    module, _, function = call.partition(":")
    found = importlib.util.find_spec(module)
    assert found is not None and found.origin is not None, f"{module} is not importable from the tests"
    site = tmp_path / "worker_site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "if '--multiprocessing-fork' in sys.argv:\n"
        f"    sys.path.insert(0, {str(Path(found.origin).parent)!r})\n"
        f"    import {module}\n"
        f"    {module}.{function}()\n")
    before = {name: os.environ.get(name) for name in ("PYTHONPATH", *env)}
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), before["PYTHONPATH"]]))
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
