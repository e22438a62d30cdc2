"""Where this directory's kernel tests run, and the marker of tests that need a real GPU."""

from __future__ import annotations

import pytest
from omni_backends_cuda.probe import probe

CUDA_REASON = probe()
#: tensors for kernel tests: CUDA when usable, else CPU (Triton's interpreter; see conftest.py)
DEVICE = "cpu" if CUDA_REASON is not None else "cuda"
PLUGIN = "omni_backends_cuda.plugin"


def needs_gpu(fn):
    """``@pytest.mark.gpu``, skipped with the probe's reason where no CUDA device is usable."""
    return pytest.mark.gpu(pytest.mark.skipif(CUDA_REASON is not None, reason=f"needs CUDA: {CUDA_REASON}")(fn))
