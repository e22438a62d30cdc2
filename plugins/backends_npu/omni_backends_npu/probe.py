"""Availability of the ``npu`` platform (runs at every start-up: fast, side-effect free, stable).

``torch_npu`` is looked up with ``importlib.util.find_spec`` first, so a machine without it answers
"torch_npu not installed" without importing torch (``omnicore plugins`` stays torch-free). Only when torch_npu is
installed is it imported, to ask ``torch.npu`` for a device.
"""

from __future__ import annotations

import functools
import importlib.util

#: the reason reported where torch_npu cannot be found (checked verbatim by the CLI tests)
NOT_INSTALLED = "torch_npu not installed"


def probe() -> str | None:
    """``None`` when an Ascend device is usable through torch_npu, else the reason (cached per process)."""
    return _probe_once()


@functools.lru_cache(maxsize=1)
def _probe_once() -> str | None:
    if not torch_npu_installed():
        return NOT_INSTALLED
    try:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        npu = getattr(torch, "npu")  # noqa: B009 - registered by torch_npu at import
        count = int(npu.device_count()) if npu.is_available() else 0
    except Exception as exc:  # noqa: BLE001 - a broken driver or CANN install is a reason, never an exception
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"torch_npu failed to initialise: {type(exc).__name__}: {first}".rstrip(": ")
    return classify(True, count)


def classify(installed: bool, device_count: int) -> str | None:
    """The reason the platform cannot run, from what was found (pure; what :func:`probe` reports)."""
    if not installed:
        return NOT_INSTALLED
    if device_count <= 0:
        return "no Ascend NPU visible to torch_npu (no device, no driver, or ASCEND_RT_VISIBLE_DEVICES hides them)"
    return None


def torch_npu_installed() -> bool:
    """Whether ``torch_npu`` can be imported, decided without importing it (or torch)."""
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False
