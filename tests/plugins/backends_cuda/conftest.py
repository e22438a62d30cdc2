"""Kernel tests run Triton's interpreter on CPU tensors unless a CUDA device is usable.

``TRITON_INTERPRET`` must be set before the plugin's kernel modules are imported (Triton decides at decoration),
so it is set here, at collection, and only when the ``cuda`` platform's probe says no device is usable.
"""

from __future__ import annotations

import os

from omni_backends_cuda.probe import probe

CUDA_REASON = probe()
if CUDA_REASON is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
