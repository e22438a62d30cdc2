"""Where the Triton kernels can run, decided without touching the device (no synchronisation).

Kernels run on CUDA tensors; with ``TRITON_INTERPRET=1`` set before this package is imported (the test suite
does) Triton's interpreter runs them on CPU tensors instead, so every kernel is testable without a GPU.
"""

from __future__ import annotations

import functools
import os
from typing import Any

#: Triton decides interpret mode when a kernel is decorated (at import), so this is read once, at import too
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: dtypes the kernels load and store (they compute in fp32)
KERNEL_DTYPES = ("float32", "float16", "bfloat16")


def on_kernel_device(*tensors: Any) -> bool:
    """True when every tensor lives where the kernels run (CUDA, or the CPU in interpret mode), on one device."""
    first = None
    for t in tensors:
        dev = t.device
        if not (dev.type == "cuda" or (INTERPRET and dev.type == "cpu")):
            return False
        if first is None:
            first = dev
        elif dev != first:
            return False
    return True


def kernel_dtype(*tensors: Any) -> bool:
    """True when every tensor has a dtype the kernels handle (bf16 needs compute capability 8.0 on a GPU)."""
    for t in tensors:
        name = str(t.dtype).removeprefix("torch.")
        if name not in KERNEL_DTYPES:
            return False
        if name == "bfloat16" and t.device.type == "cuda" and not bf16_capable(t.device.index or 0):
            return False
    return True


@functools.lru_cache(maxsize=16)
def bf16_capable(index: int) -> bool:
    """Whether CUDA device ``index`` computes bf16 in Triton (Ampere, compute capability 8.0, and newer)."""
    import torch

    return tuple(torch.cuda.get_device_capability(index)) >= (8, 0)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())
