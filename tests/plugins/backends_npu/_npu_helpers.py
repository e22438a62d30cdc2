"""Helpers for the npu backend tests (imported by name; pytest puts this folder on sys.path).

The npu backends are registered here a second time, **for the cpu platform and in tests only**, as variants whose
op seam holds :class:`~omni_backends_npu.cpu_reference.CpuReferenceOps` (the CPU implementation of the documented
op semantics): that is how the conformance kit and the end-to-end model runs reach the real dispatch code of
``npu_varlen`` / ``npu_laser`` / ``npu_rainfusion`` on a machine without an NPU.
"""

from __future__ import annotations

from typing import Any

import pytest
from omni_backends_npu import attention
from omni_backends_npu.cpu_reference import CpuReferenceOps
from omni_backends_npu.plugin import capabilities
from omni_backends_npu.probe import probe
from omni_backends_npu.seam import use_ops
from omnicore import hookimpl
from omnicore.specs import AttentionBackendSpec

NPU_REASON = probe()
PLUGIN = "omni_backends_npu.plugin"
#: the ops the cpu-platform variants run on (tests read ``OPS.calls``; clear it first)
OPS = CpuReferenceOps()


def needs_npu(fn: Any) -> Any:
    """``@pytest.mark.npu``, skipped with the probe's reason where no Ascend device is usable."""
    return pytest.mark.npu(pytest.mark.skipif(NPU_REASON is not None, reason=f"needs an NPU: {NPU_REASON}")(fn))


def npu_varlen_on_cpu(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    with use_ops(OPS):
        return attention.npu_varlen_attention(q, k, v, **kwargs)


def npu_laser_on_cpu(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    with use_ops(OPS):
        return attention.npu_laser_attention(q, k, v, **kwargs)


def npu_rainfusion_on_cpu(q: Any, k: Any, v: Any, **kwargs: Any) -> Any:
    with use_ops(OPS):
        return attention.npu_rainfusion_attention(q, k, v, **kwargs)


npu_rainfusion_on_cpu.sparse_planner = attention.npu_rainfusion_attention.sparse_planner  # type: ignore[attr-defined]


class CpuSeamBackends:
    """Registers ``npu_varlen`` / ``npu_laser`` / ``npu_rainfusion`` for platform ``cpu`` (float32 too), with the
    capabilities the plugin declares for ``npu``."""

    @hookimpl
    def omnicore_register_attention_backends(self, register: Any) -> None:
        for name, fn, sparse in (("npu_varlen", "npu_varlen_on_cpu", False), ("npu_laser", "npu_laser_on_cpu", False),
                                 ("npu_rainfusion", "npu_rainfusion_on_cpu", True)):
            register(AttentionBackendSpec(
                name=name, impl=f"_npu_helpers:{fn}", priority=0,
                capabilities=capabilities(platforms=("cpu",), dtypes=("float32", "bfloat16", "float16"),
                                          sparse=sparse),
                description=f"{name} on the CPU op seam (tests only)"))
