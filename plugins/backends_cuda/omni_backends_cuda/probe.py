"""Availability of the ``cuda`` platform (runs at every start-up: fast, side-effect free, stable).

The probe never imports torch just to learn that it is a CPU-only build: it reads ``torch/version.py`` from the
installed package instead (importing torch takes seconds on a loaded machine). Only a CUDA build of torch is
imported, to count devices and read device 0's compute capability.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
from pathlib import Path

#: oldest compute capability served: Volta (the Triton kernels and torch's fused SDPA paths need sm_70+)
MIN_CAPABILITY = (7, 0)


def probe() -> str | None:
    """``None`` when a usable CUDA device is visible, else the reason (cached: the answer is stable per process)."""
    return _probe_once()


@functools.lru_cache(maxsize=1)
def _probe_once() -> str | None:
    build = torch_build()
    if build is None:
        return "torch is not installed"
    version, cuda = build
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not cuda:
        return classify(version, cuda, 0, None, visible)
    if visible is not None and visible.strip() in ("", "-1"):
        return classify(version, cuda, 0, None, visible)
    try:
        import torch

        count = int(torch.cuda.device_count())
        capability = tuple(torch.cuda.get_device_capability(0)) if count else None
    except Exception as exc:  # noqa: BLE001 - a broken driver is a reason, never an exception
        return f"CUDA driver unusable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip()
    return classify(version, cuda, count, capability, visible)


def classify(version: str, cuda: str | None, device_count: int, capability: tuple[int, ...] | None,
             visible: str | None = None) -> str | None:
    """The reason the platform cannot run from what was found (pure; what :func:`probe` reports)."""
    if not cuda:
        return f"torch {version} is a CPU-only build (no CUDA support); install a CUDA build of torch"
    if visible is not None and visible.strip() in ("", "-1"):
        return f"no CUDA device visible (CUDA_VISIBLE_DEVICES={visible!r})"
    if device_count <= 0:
        return f"no CUDA device visible (torch {version} built for CUDA {cuda}; no GPU or no driver)"
    if capability is None or tuple(capability[:2]) < MIN_CAPABILITY:
        have = "unknown" if capability is None else ".".join(map(str, capability[:2]))
        need = ".".join(map(str, MIN_CAPABILITY))
        return f"CUDA device 0 has compute capability {have}, too old (needs >= {need})"
    return None


def torch_build() -> tuple[str, str | None] | None:
    """``(torch version, CUDA version or None)`` of the installed torch, without importing it when it is not
    imported yet; ``None`` when torch is not installed."""
    mod = sys.modules.get("torch")
    if mod is not None and getattr(mod, "version", None) is not None:
        return str(mod.__version__), getattr(mod.version, "cuda", None)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "version.py"
        if path.is_file():
            return parse_version_file(path.read_text(encoding="utf-8", errors="replace"))
    return "unknown", None


def parse_version_file(text: str) -> tuple[str, str | None]:
    """``(__version__, cuda)`` from the text of ``torch/version.py``."""
    version = re.search(r"^__version__\s*(?::[^=]*)?=\s*['\"]([^'\"]*)['\"]", text, re.M)
    cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*(?:['\"]([^'\"]*)['\"]|None)", text, re.M)
    return (version.group(1) if version else "unknown"), (cuda.group(1) if cuda and cuda.group(1) else None)
