"""Where replicas keep job inputs and results: one directory every replica sees, named by an fsspec URL.

``--storage-url file:///shared/omnicore`` (or a plain path) is a directory that every replica mounts at the same
place (NFS, a shared volume): uploads are written there once by the replica that accepted them and read by
whichever replica runs the job; results are written there (temp file, fsync, rename) by the replica that finished
the job, so ``Range`` reads work from any replica. The URL is resolved through fsspec so the same option can name
other filesystems later; today only filesystems that resolve to a local path are accepted (an ``s3://`` URL is
refused with one line), because results are served with ``sendfile`` and written by atomic rename.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ConfigError


def resolve_local(url: str) -> Path:
    """The local directory an fsspec URL names (``file:///x``, ``local://x`` or a plain path)."""
    import fsspec.core
    from fsspec.implementations.local import LocalFileSystem

    fs, path = fsspec.core.url_to_fs(url)
    if not isinstance(fs, LocalFileSystem):
        proto = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
        raise ConfigError("storage_url", f"{url!r} is on {proto!r}; only a directory every replica mounts "
                                         "(file:///path) is supported for results and inputs so far")
    return Path(path)


def checkpoint_stem(root: Path, job_id: str, token: int, step: int) -> Path:
    """Where a step checkpoint of ``job_id`` goes: ``<root>/checkpoints/<job id>.<token>.<step>`` (+ ``.json`` and
    ``.safetensors``). The lease token in the name keeps a stale holder from overwriting the current one's files."""
    path = root / "checkpoints"
    path.mkdir(parents=True, exist_ok=True)
    return path / f"{job_id}.{int(token)}.{int(step)}"


def remove_checkpoints(root: Path, job_id: str, token: int | None = None, keep: Path | None = None) -> None:
    """Delete ``job_id``'s checkpoint files (only those of lease ``token`` when given), except ``keep``'s."""
    kept = keep.name[: -len(".json")] if keep is not None and keep.name.endswith(".json") else None
    pattern = f"{job_id}.{int(token)}.*" if token is not None else f"{job_id}.*"
    for path in (root / "checkpoints").glob(pattern):
        stem = path.name.rsplit(".", 1)[0]
        if stem != kept:
            path.unlink(missing_ok=True)


class SharedStorage:
    """Inputs under ``<root>/inputs/<job id>/``, results as ``<root>/results/<job id>[.<token>].<ext>``, step
    checkpoints under ``<root>/checkpoints/`` (:func:`checkpoint_stem`)."""

    def __init__(self, url: str | Path) -> None:
        self.url = str(url)
        self.root = resolve_local(self.url)
        (self.root / "results").mkdir(parents=True, exist_ok=True)
        (self.root / "inputs").mkdir(parents=True, exist_ok=True)

    def inputs_dir(self, job_id: str) -> Path:
        path = self.root / "inputs" / job_id
        path.mkdir(parents=True, exist_ok=True)
        return path

    def remove_inputs(self, job_id: str) -> None:
        shutil.rmtree(self.root / "inputs" / job_id, ignore_errors=True)

    def result_path(self, job_id: str, ext: str) -> Path:
        return self.root / "results" / f"{job_id}.{ext}"

    def write_result(self, job_id: str, ext: str, write: Callable[[Path], Any]) -> Path:
        """``write(tmp)`` fills a temp file, which is fsynced and renamed into place (never a partial result)."""
        final = self.result_path(job_id, ext)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        write(tmp)
        with open(tmp, "rb+") as fh:
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        return final

    def remove_results(self, job_id: str) -> None:
        """Every result file of ``job_id`` (one per claim that got as far as writing, at most one recorded)."""
        for path in (self.root / "results").glob(f"{job_id}.*"):
            path.unlink(missing_ok=True)

    def checkpoint_stem(self, job_id: str, token: int, step: int) -> Path:
        return checkpoint_stem(self.root, job_id, token, step)

    def remove_checkpoints(self, job_id: str, token: int | None = None, keep: Path | None = None) -> None:
        remove_checkpoints(self.root, job_id, token, keep)
