"""Planning a Hugging Face Hub repository from its metadata alone: config files and safetensors headers.

``omnicore plan org/repo`` lists the repository's files (``HfApi.model_info``), downloads its small JSON/text
configs, and reads each ``*.safetensors`` file's header with two HTTP range requests (the 8-byte length, then the
header): no tensor data crosses the network. What it read is written into a **metadata mirror** under the cache
(``<cache>/plan-metadata/<org>--<repo>@<revision>/``): the configs as they are, and each weight file as a
*header-only* safetensors file (the same 8 bytes and JSON header, no data). The mirror is a checkpoint directory
every model plugin's detector and ``plan_model`` read as usual; ``header_bytes_read`` counts the bytes fetched
from the weight files.

The range reader works on any ``http(s)://`` or ``file://`` URL (:func:`read_header_at`), so it is tested on
local files and on a real loopback HTTP server; the Hub is only where the URLs come from
(``huggingface_hub.hf_hub_url``, with ``HF_ENDPOINT`` / ``endpoint=`` honoured).
"""

from __future__ import annotations

import json
import os
import re
import struct
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from ..errors import InvalidRequest
from .headers import MAX_HEADER, ByteCounter

#: files copied into the mirror whole (configs; tokenizer vocabularies are not needed to plan)
CONFIG_SUFFIXES = (".json", ".txt", ".yaml", ".yml")
CONFIG_SKIP = re.compile(r"(^|/)(tokenizer|vocab|merges|special_tokens_map)[^/]*$")
MAX_CONFIG_BYTES = 4 * 1024 * 1024
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_repo_id(text: str) -> bool:
    """``org/name`` (and not an existing path): what ``omnicore plan`` treats as a Hub repository."""
    return bool(REPO_ID.match(text)) and not Path(text).expanduser().exists()


def _headers(token: str | None) -> dict[str, str]:
    token = token or os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    return {"User-Agent": "omnicore-plan", **({"Authorization": f"Bearer {token}"} if token else {})}


def read_range(url: str, start: int, length: int, *, token: str | None = None, timeout: float = 30.0) -> bytes:
    """``length`` bytes of ``url`` from ``start``: an HTTP ``Range`` request (a server that ignores the range and
    sends the whole file is refused rather than downloaded), or a seek into a ``file://`` URL."""
    if length <= 0:
        return b""
    if url.startswith("file://"):
        with open(urllib.request.url2pathname(url[len("file://"):]), "rb") as f:
            f.seek(start)
            return f.read(length)
    req = urllib.request.Request(url, headers={**_headers(token), "Range": f"bytes={start}-{start + length - 1}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - http(s) URLs of a repository
        if resp.status != 206:
            raise InvalidRequest("model", f"{url}: the server did not honour a byte range (HTTP {resp.status}); "
                                          "planning reads safetensors headers only and will not download weights")
        data: bytes = resp.read(length + 1)
    if len(data) != length:
        raise InvalidRequest("model", f"{url}: asked for {length} bytes at {start}, got {len(data)}")
    return data


def read_header_at(url: str, counter: ByteCounter | None = None, *, token: str | None = None) -> bytes:
    """The raw safetensors prefix of ``url`` (8-byte little-endian length + JSON header), in two range reads."""
    head = read_range(url, 0, 8, token=token)
    if len(head) != 8:
        raise InvalidRequest("model", f"{url}: not a safetensors file (shorter than 8 bytes)")
    (size,) = struct.unpack("<Q", head)
    if size > MAX_HEADER:
        raise InvalidRequest("model", f"{url}: safetensors header of {size} bytes is implausibly large")
    raw = read_range(url, 8, size, token=token)
    json.loads(raw)  # a corrupt header fails here, naming nothing half-written
    if counter is not None:
        counter.read += 8 + len(raw)
        counter.files += 1
    return head + raw


def fetch_whole(url: str, *, token: str | None = None, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """A small file (a config), refused past ``limit`` bytes."""
    if url.startswith("file://"):
        data = Path(urllib.request.url2pathname(url[len("file://"):])).read_bytes()
    else:
        req = urllib.request.Request(url, headers=_headers(token))
        with urllib.request.urlopen(req, timeout=30.0) as resp:  # noqa: S310
            data = resp.read(limit + 1)
    if len(data) > limit:
        raise InvalidRequest("model", f"{url}: a config file over {limit} bytes")
    return data


def mirror_files(base_url: str, files: Iterable[str], target: Path, counter: ByteCounter | None = None, *,
                 token: str | None = None) -> Path:
    """Write the metadata mirror of the repository at ``base_url`` (``base_url + "/" + name`` for each file)
    into ``target``: configs whole, weights as header-only safetensors files. Returns ``target``."""
    target.mkdir(parents=True, exist_ok=True)
    for name in sorted(set(files)):
        if name.startswith("/") or ".." in Path(name).parts:
            raise InvalidRequest("model", f"repository file name {name!r} escapes the repository")
        url = base_url.rstrip("/") + "/" + urllib.request.pathname2url(name).lstrip("/")
        out = target / name
        if name.endswith(".safetensors"):
            data = read_header_at(url, counter, token=token)
        elif name.endswith(CONFIG_SUFFIXES) and not CONFIG_SKIP.search(name):
            data = fetch_whole(url, token=token)
        else:
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".part")
        tmp.write_bytes(data)
        tmp.replace(out)
    return target


def mirror_hub_repo(repo_id: str, cache: Path, counter: ByteCounter | None = None, *, revision: str | None = None,
                    endpoint: str | None = None, token: str | None = None) -> Path:
    """The metadata mirror of Hub repository ``repo_id`` (file list from ``HfApi.model_info``, URLs from
    ``hf_hub_url``; ``endpoint`` defaults to ``HF_ENDPOINT`` / huggingface.co)."""
    from huggingface_hub import HfApi, hf_hub_url

    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None  # read now, not at huggingface_hub's import
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(repo_id, revision=revision)
    except Exception as exc:  # offline, unknown repo, gated: one line naming the repo
        raise InvalidRequest("model", f"cannot read the file list of Hub repository {repo_id!r}: "
                                      f"{type(exc).__name__}: {exc}") from None
    files = [s.rfilename for s in (info.siblings or [])]
    if not files:
        raise InvalidRequest("model", f"Hub repository {repo_id!r} lists no files")
    rev = info.sha or revision or "main"
    marker = "/__omnicore_base__"
    base = hf_hub_url(repo_id, marker.lstrip("/"), revision=rev, endpoint=endpoint).rsplit(marker, 1)[0]
    target = cache / "plan-metadata" / f"{repo_id.replace('/', '--')}@{rev}"
    return mirror_files(base, files, target, counter, token=token)


def header_only(path: Path) -> bool:
    """Whether a safetensors file is a mirror's header-only stub (its data section is absent)."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size == 8 + size


__all__ = ["header_only", "looks_like_repo_id", "mirror_files", "mirror_hub_repo", "read_header_at", "read_range"]
